"""Adaptive shapes, configuration by configuration, in one process, interleaved: tok/s over plain decoding per domain
(median [min-max] of the per-round ratios, with plain decoding measured again as the control) and where each
configuration's cycle goes (µs of drafting, verify and the rest per cycle, cycles that drafted, nodes and tokens per
cycle). A label is a bench drafter name (`eagle3`, `ngram@k4`, `mtp@adaptive`) with optional settings of its
adaptive rule after `%`: `eagle3%realized_loss=0`, `ngram%plain_run_most=16@adaptive` (the `@shape` last), so one
run compares a rule's settings on the same prompts. `--warm N` runs N untimed rounds first (the rule learns).

    PYTHONPATH=$PWD python scripts/adaptive_ab.py BUNDLE LABEL[,LABEL...] [--domains action,text] [--rounds 8]
        [--warm 0] [--temperature 0]
"""
import argparse
import os
import statistics
from dataclasses import replace

from runtime.commands.bench import CONTROL, bench_prompts, open_sessions
from runtime.config import RuntimeConfig
from runtime.model import bundle as bundle_io
from runtime.serving.session import GenerationParams, prompt_format
from runtime.text.tokenizer import Tokenizer


def parse_label(label: str):
    """'eagle3%realized_loss=0@adaptive' -> ('eagle3@adaptive', {'realized_loss': 0.0})."""
    name, _, shape = label.partition("@")
    base, *settings = name.split("%")
    values = {}
    for s in settings:
        key, _, value = s.partition("=")
        values[key] = float(value) if "." in value or "e" in value else int(value)
    return base + ("@" + shape if shape else ""), values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("labels")
    ap.add_argument("--domains", default="action,text")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warm", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    root = os.path.abspath(args.bundle)
    cfg = replace(RuntimeConfig(), bundle=root)
    bundle = bundle_io.load(root, verify_checksums=False)
    fmt = prompt_format(bundle, Tokenizer(bundle.path(bundle.tokenizer)))
    domains = args.domains.split(",")
    sets = bench_prompts(fmt, domains)
    prompts = [(d, p) for d in domains for p in sets[d]]
    labels = args.labels.split(",")
    configs = {label: parse_label(label)[0].split("@")[0] for label in labels}
    configs.update({"none": "none", CONTROL: "none"})
    opened, _ = open_sessions(cfg, {lab: kind for lab, kind in configs.items()}, prompts[0][1])
    sessions = {}
    for label, session in opened.items():  # open_sessions read the shape from the label: give it the bench name
        for key, value in (parse_label(label)[1] if label in labels else {}).items():
            setattr(session.engine.policy, key, value)
        sessions[label] = session
    order = list(sessions)
    keys = ("tokens", "wall", "draft", "verify", "other", "cycles", "skipped", "nodes")
    acc = {(lab, d): {**{k: 0.0 for k in keys}, "tps": []} for lab in order for d in domains}
    try:
        for r in range(-args.warm, args.rounds):
            per = {(lab, d): [0, 0.0] for lab in order for d in domains}
            for i, (domain, prompt) in enumerate(prompts):
                k = (r * len(prompts) + i) % len(order)
                for label in order[k:] + order[:k]:
                    res = sessions[label].generate(prompt, GenerationParams(
                        max_tokens=48, temperature=args.temperature, seed=1000 * (r + args.warm) + i))
                    if r < 0:
                        continue
                    s, a = res.stats, acc[label, domain]
                    for key, value in (("tokens", s.tokens), ("wall", s.wall_s - s.prefill_s), ("draft", s.draft_s),
                                       ("verify", s.verify_s), ("other", s.other_s), ("cycles", s.cycles),
                                       ("skipped", s.skipped_cycles), ("nodes", s.mean_nodes * s.cycles)):
                        a[key] += value
                    per[label, domain][0] += s.tokens
                    per[label, domain][1] += s.wall_s
            if r >= 0:
                for key, (tokens, wall) in per.items():
                    acc[key]["tps"].append(tokens / wall)
    finally:
        for s in sessions.values():
            s.close()
    for d in domains:
        print(f"== {d}, T = {args.temperature:g}, {args.rounds} rounds")
        for label in order:
            a, base = acc[label, d], acc["none", d]
            c = max(a["cycles"], 1.0)
            ratios = [x / y for x, y in zip(a["tps"], base["tps"])]
            print(f"{label:34s} {statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]  µs a cycle: "
                  f"draft {1e6 * a['draft'] / c:7.1f} verify {1e6 * a['verify'] / c:7.1f} other {1e6 * a['other'] / c:6.1f}"
                  f"  | cycles {int(a['cycles'])}, drafted {int(a['cycles'] - a['skipped'])}, "
                  f"nodes {a['nodes'] / c:.2f} and tokens {a['tokens'] / c:.2f} a cycle")


if __name__ == "__main__":
    main()
