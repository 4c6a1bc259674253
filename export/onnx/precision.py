"""Compare a bundle's ONNX target graphs by precision: held-out loss on the zoo's held-out sets and plain decode
speed, measured side by side in one process (decode rounds interleave the precisions, with a second copy of the
float graph as the control).

    python -m export.onnx.precision --bundle build/bundles/zoo [--precisions auto int8 int4] [--sequences 40]

Loss: mean next-token cross-entropy (nats, unweighted) over the first --sequences held-out planner and action
examples, regenerated from zoo/MANIFEST.yaml's seed (a bundle derived from the zoo, like the stand-in, shares
its tokenizer). Each sequence is one prefill forward through the graph (runtime/backends/onnx.py)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Dict, List, Sequence

import numpy as np

from runtime.model import bundle as bundle_mod
from runtime.commands.bench_backend import PROMPT, decode_loop, measure_bandwidth, open_target
from runtime.errors import EdgespecError

ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zoo")


def heldout_sequences(tokenizer_path: str, n: int) -> Dict[str, List[np.ndarray]]:
    """The first n held-out planner and action sequences of the zoo (token ids)."""
    from tokenizers import Tokenizer

    from export.zoo.report import _heldout_data
    from export.zoo.train import read_manifest

    manifest = read_manifest(ZOO)
    manifest["build_config"] = {**manifest["build_config"], "n_text": 0}
    data, _, _ = _heldout_data(ZOO, manifest, Tokenizer.from_file(tokenizer_path))
    return {k: v[:n] for k, v in data.items() if k in ("planner_heldout", "action_heldout")}


def mean_loss(target, sequences: Sequence[np.ndarray]) -> float:
    """Mean next-token cross-entropy (nats) of `target` over the sequences, one prefill forward each."""
    total, count = 0.0, 0
    for ids in sequences:
        target.reset()
        logits = target.forward(ids, np.arange(len(ids))).logits[:-1].astype(np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logz = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1)))
        total += float((logz - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    return total / count


def compare(bundle_dir: str, precisions: Sequence[str], sequences: int, rounds: int, decode_tokens: int,
            threads: int) -> List[str]:
    b = bundle_mod.load(bundle_dir, verify_checksums=False)
    rows = max(PROMPT + decode_tokens + 1, 1024)
    names = list(precisions) + [f"{precisions[0]} (control)"]
    targets = {n: open_target(b, "onnx", rows, threads, precision=n.split(" ")[0]) for n in names}
    data = heldout_sequences(b.path(b.tokenizer), sequences)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, b.target.spec.vocab_size, PROMPT)
    tps: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms up
        for i in rng.permutation(len(names)):
            secs, _ = decode_loop(targets[names[i]], prompt, decode_tokens)
            if r:
                tps[names[i]].append(decode_tokens / secs)
    bw = measure_bandwidth()
    base = statistics.median(tps[names[0]])
    lines = [f"bundle {b.name}: {len(data['planner_heldout'])} planner + {len(data['action_heldout'])} action held-out "
             f"sequences; decode {decode_tokens} tokens after {PROMPT}, {rounds} interleaved rounds; bandwidth "
             f"{bw / 1e9:.1f} GB/s", "",
             "| precision | weights MB | tok/s median [min-max] | vs first | % of bound | planner loss | action loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    losses = {}
    for n in names:
        t = targets[n]
        if "control" not in n:
            losses[n] = (mean_loss(t, data["planner_heldout"]), mean_loss(t, data["action_heldout"]))
        pl, al = losses[n.split(" ")[0]]
        d0 = losses[names[0]]
        med = statistics.median(tps[n])
        delta = "" if n == names[0] else f" ({pl - d0[0]:+.5f})"
        adelta = "" if n == names[0] else f" ({al - d0[1]:+.5f})"
        lines.append(f"| {n} | {t.weight_bytes / 1e6:.1f} | {med:.1f} [{min(tps[n]):.1f}-{max(tps[n]):.1f}] | "
                     f"{med / base:.2f}x | {100 * med * t.weight_bytes / bw:.0f}% | {pl:.5f}{delta} | {al:.5f}{adelta} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.onnx.precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--precisions", nargs="+", default=["auto", "int8", "int4"])
    ap.add_argument("--sequences", type=int, default=40, help="held-out sequences per domain")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        for line in compare(a.bundle, a.precisions, a.sequences, a.rounds, a.decode_tokens, a.threads):
            print(line, flush=True)
    except EdgespecError as exc:
        print(f"python -m export.onnx.precision: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
