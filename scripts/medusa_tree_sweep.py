"""Pick the zoo's Medusa tree by measurement (issue 15).

1. Calibrate: greedy-decode calibration prompts (NOT the bench prompts) with the plain target, read the final-norm
   hidden at every position, and count how often head d's top-i token is the target's token d+2 places on:
   accuracy[d, i]. Candidate trees are grown from it by Medusa's greedy search (`tune_tree`) at several sizes.
2. Sweep: the shipped trees, the chain and the candidates decode the bench prompts (`edgespec bench`'s), greedy
   and T = 1, against plain decoding, configurations rotated per prompt inside each round (one process, one
   target); tok/s speedup = median over rounds of the per-round ratio to plain, with min-max; a second plain
   row ('none (control)') gives the noise. Greedy outputs are checked identical to plain. The same ratios are
   also given in process CPU time (tokens per CPU-second of this process), which a machine shared with other
   jobs disturbs less than wall time.

    PYTHONPATH=. python scripts/medusa_tree_sweep.py --bundle build/bundles/zoo --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from export.drafters.medusa import tune_tree
from runtime.backends.onnx_net import OnnxNet
from runtime.commands.bench import BENCH_REQUESTS, bench_prompts
from runtime.config import RuntimeConfig
from runtime.drafters.medusa import MedusaDrafter, standard_trees
from runtime.decode.engine import Engine
from runtime.text.prompts import format_observation
from runtime.sampling import SamplingParams
from runtime.serving.session import Session
from runtime.model.tensors import read_safetensors

CALIBRATION = [("planner", {"instruction": s, "context": ""}) for s in (
    "bring two apples from the kitchen to the office", "open the fridge and put the milk on the table",
    "pick up the blue mug in the kitchen and hand it to Dave", "put three forks in the drawer",
    "close the cabinet in the bathroom", "move the green book from the bedroom to the shelf in the garage")] + [
    ("text", {"text": s}) for s in ("All the world's a stage", "Friends, Romans, countrymen, lend me your ears")] + [
    ("action", {"instruction": s, "observation": format_observation(o)}) for s, o in (
        ("pick up the blue mug", [0.10, 0.20, 0.05, 0.0, 0.0, 0.12, 0.18, 0.06]),
        ("place the bottle in the box", [-0.2, 0.1, 0.3, 0.1, 0.0, -0.1, 0.2, 0.1]))]


def measure_accuracy(session, drafter: MedusaDrafter, prompts, max_tokens: int, width: int = 10) -> np.ndarray:
    """accuracy[d, i]: share of positions where head d's rank-i token is the greedy continuation d+2 on."""
    plain = Engine(session.target, None, session.engine.eos, prefix_cache=False)
    hits = np.zeros((drafter.num_heads, width))
    seen = np.zeros(drafter.num_heads)
    for text in prompts:
        ids = session.tokenizer.encode(text)
        out = plain.generate(ids, SamplingParams(), max_tokens).tokens
        seq = ids + out
        session.target.reset()
        h = session.target.forward(np.asarray(seq, np.int64), np.arange(len(seq)), None, ("final_norm",)).taps["final_norm"]
        for t in range(len(ids) - 1, len(seq) - 2):  # hidden at t: the target predicts t+1, head d predicts t+d+2
            logits = drafter.head_logits(np.asarray(h[t], np.float32), drafter.num_heads)
            for d in range(drafter.num_heads):
                if t + d + 2 >= len(seq):
                    break
                seen[d] += 1
                rank = int((logits[d] > logits[d][seq[t + d + 2]]).sum())
                if rank < width:
                    hits[d, rank] += 1
    return hits / np.maximum(seen, 1)[:, None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="build/bundles/zoo")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--sizes", default="6,10,16,24,32,48", help="node counts of the tuned candidates ('' = none)")
    ap.add_argument("--trees", default="", help="only these of the shipped / bundle trees (comma-separated; "
                                                "default all)")
    ap.add_argument("--json", help="write the rows and the measured accuracy here")
    ap.add_argument("--onnx-heads", action="store_true", help="also run each tree with the heads on the bundle's "
                                                              "Medusa ONNX graph (label +onnx); plain labels = numpy heads")
    args = ap.parse_args()
    cfg = RuntimeConfig(bundle=args.bundle)
    cfg = replace(cfg, backend=replace(cfg.backend, kind=args.backend), drafter=replace(cfg.drafter, kind="none"),
                  memory=replace(cfg.memory, prefix_cache=False))
    session = Session(cfg)  # one target; every engine below shares it (prefix cache off: no engine keeps rows)
    entry = session.bundle.drafter("medusa")
    weights = read_safetensors(session.bundle.path(entry.files[0]))
    spec = session.target.spec
    probe = MedusaDrafter(weights, "chain", num_tokens=8, hidden=spec.hidden_size, vocab=spec.vocab_size)
    calib = [session.prompts.render(task, **v) for task, v in CALIBRATION if session.prompts.has(task)]
    t0 = time.perf_counter()
    acc = measure_accuracy(session, probe, calib, args.max_tokens)
    print(f"accuracy (head x rank, {len(calib)} calibration prompts, {time.perf_counter() - t0:.0f} s):", file=sys.stderr)
    for d, row in enumerate(acc):
        print(f"  head {d}: " + " ".join(f"{a:.3f}" for a in row[:6]), file=sys.stderr)
    trees = {"chain": "chain", **{k: v for k, v in standard_trees().items()}}
    if isinstance(entry.params.get("tree"), list):
        trees["bundle"] = [tuple(p) for p in entry.params["tree"]]
    if args.trees:
        trees = {k: v for k, v in trees.items() if k in args.trees.split(",")}
    for n in (int(x) for x in args.sizes.split(",") if x):
        choices, expected = tune_tree(acc, max_nodes=n, min_gain=0.0)
        trees[f"tuned{n}"] = [tuple(p) for p in choices]
        print(f"  tuned{n}: expected tau {expected:.2f}, depth {max(len(p) for p in choices)}", file=sys.stderr)
    engines = {"none": Engine(session.target, None, session.engine.eos, prefix_cache=False),
               "none (control)": Engine(session.target, None, session.engine.eos, prefix_cache=False)}
    for name, tree in trees.items():
        d = MedusaDrafter(weights, tree, num_tokens=probe.num_heads, hidden=spec.hidden_size, vocab=spec.vocab_size)
        engines[name] = Engine(session.target, d, session.engine.eos, prefix_cache=False)
        if args.onnx_heads:
            net = OnnxNet(session.bundle.path(entry.backends["onnx"].files[0]), threads=cfg.backend.threads)
            d = MedusaDrafter(weights, tree, num_tokens=probe.num_heads, hidden=spec.hidden_size,
                              vocab=spec.vocab_size, net=net)
            engines[name + "+onnx"] = Engine(session.target, d, session.engine.eos, prefix_cache=False)
    bench = [p for ps in bench_prompts(session.prompts, [d for d in BENCH_REQUESTS if session.prompts.has(d)]).values()
             for p in ps]
    ids = [session.tokenizer.encode(p) for p in bench]
    temps = [float(t) for t in args.temperatures.split(",")]
    labels = list(engines)
    # per (label, T): per-round tokens and seconds, cycles and committed tokens, outputs
    tally = {(lab, t): {"tok": [0] * args.rounds, "sec": [0.0] * args.rounds, "cpu": [0.0] * args.rounds, "cyc": 0,
                        "emit": 0.0, "out": []}
             for lab in labels for t in temps}
    for e in engines.values():
        e.generate(ids[0], SamplingParams(), 4)  # warm-up
    for r in range(args.rounds):
        for t in temps:
            for i, prompt in enumerate(ids):
                params = SamplingParams(temperature=t)
                k = (r * len(ids) + i) % len(labels)
                for lab in labels[k:] + labels[:k]:
                    c0 = time.process_time()
                    res = engines[lab].generate(prompt, params, args.max_tokens, seed=1000 * r + i)
                    s = tally[lab, t]
                    s["cpu"][r] += time.process_time() - c0
                    s["tok"][r] += res.stats.tokens
                    s["sec"][r] += res.stats.wall_s
                    s["cyc"] += res.stats.cycles
                    s["emit"] += res.stats.tau * res.stats.cycles
                    s["out"].append(res.tokens)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for t in temps:
        base = tally["none", t]
        base_tps = [a / b for a, b in zip(base["tok"], base["sec"])]
        base_cpu = [a / b for a, b in zip(base["tok"], base["cpu"])]
        for lab in labels:
            s = tally[lab, t]
            tps = [a / b for a, b in zip(s["tok"], s["sec"])]
            ratios = [x / y for x, y in zip(tps, base_tps)]
            cpu = [a / b / y for a, b, y in zip(s["tok"], s["cpu"], base_cpu)]
            tree = trees.get(lab.replace("+onnx", ""))
            rows.append({"tree": lab, "T": t, "nodes": (0 if tree is None else len(engines[lab].drafter.choices)),
                         "tau": s["emit"] / s["cyc"] if s["cyc"] else 1.0, "tok_s": statistics.median(tps),
                         "speedup": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                         "cpu_speedup": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu),
                         "identical": (s["out"] == base["out"]) if t == 0 else None})
    print(f"{'tree':18s} {'T':>3s} {'nodes':>5s} {'tau':>5s} {'tok/s':>7s} {'speedup':>8s} {'[min-max]':>12s} "
          f"{'cpu-speedup':>11s} {'[min-max]':>12s} identical")
    for x in rows:
        ident = {True: "yes", False: "NO", None: "n/a"}[x["identical"]]
        print(f"{x['tree']:18s} {x['T']:3.0f} {x['nodes']:5d} {x['tau']:5.2f} {x['tok_s']:7.1f} {x['speedup']:7.2f}x "
              f"[{x['min']:.2f}-{x['max']:.2f}]{'':2s} {x['cpu_speedup']:10.2f}x [{x['cpu_min']:.2f}-{x['cpu_max']:.2f}]  {ident}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": acc.tolist(), "trees": {k: (v if isinstance(v, str) else [list(p) for p in v])
                                                           for k, v in trees.items()}, "rows": rows}, f)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
