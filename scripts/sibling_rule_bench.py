"""Measure the sibling rules side by side (issue 10): tau and ms per cycle of draft-model chains vs trees whose
siblings are drawn without replacement (the rule in use) or i.i.d. with duplicates kept, at temperature 1, on
the zoo bundle. One process, configurations interleaved per prompt, same seeds.

    .venv/bin/python scripts/sibling_rule_bench.py [--bundle build/bundles/zoo] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics

from runtime.commands.bench import bench_prompts
from runtime.sampling import SamplingParams
from runtime.serving.session import Session
from runtime.siblings import iid_with_replacement, without_replacement

CONFIGS = [("chain k=4", 1, without_replacement), ("tree b=2, without replacement", 2, without_replacement),
           ("tree b=2, i.i.d. kept", 2, iid_with_replacement), ("tree b=3, without replacement", 3, without_replacement),
           ("tree b=3, i.i.d. kept", 3, iid_with_replacement)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="build/bundles/zoo")
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    session = Session.open(args.bundle, drafter="draft_model", backend=args.backend)
    params = SamplingParams(temperature=1.0)
    prompts = [session.tokenizer.encode(p) for ps in bench_prompts(session.prompts).values() for p in ps]
    stats = {name: {"emitted": 0, "cycles": 0, "ms": []} for name, _, _ in CONFIGS}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, width, rule in CONFIGS:
                session.drafter.branching, session.drafter.sibling_rule = width, rule
                out = session.engine.generate(prompt, params, args.max_tokens, seed=1000 * r + i)
                s = stats[name]
                s["emitted"] += round(out.stats.tau * out.stats.cycles)
                s["cycles"] += out.stats.cycles
                cycle_s = out.stats.wall_s - out.stats.prefill_s
                s["ms"].append(1e3 * cycle_s / max(1, out.stats.cycles))
    print(f"{'configuration':34s} {'tau':>5s} {'ms/cycle (median, min-max over requests)':>42s}  tokens/ms")
    for name, _, _ in CONFIGS:
        s = stats[name]
        tau = s["emitted"] / s["cycles"]
        ms = statistics.median(s["ms"])
        print(f"{name:34s} {tau:5.2f} {ms:10.2f} ({min(s['ms']):.2f}-{max(s['ms']):.2f}){'':18s} {tau / ms:8.3f}")


if __name__ == "__main__":
    main()
