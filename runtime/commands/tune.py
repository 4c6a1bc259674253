"""`edgespec tune`: measure this machine once (the target's verify cost by rows, each drafter's cost and acceptance
by depth on the bundle's prompts) and choose, per drafter, template and temperature, the draft depth with the most
expected tokens per second (runtime/speculation.py). The result goes into the bundle's tune.yaml, keyed by backend,
precision and machine; `generate`, `bench` and the node then draft adaptively from it (`drafter.shape: auto`)."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from runtime.commands.bench import bench_prompts, read_prompts
from runtime.commands.bench_backend import CONTROL, interleaved_grid
from runtime.commands.common import add_model_args, runtime_config, split_list
from runtime.commands.tune_plot import write_tune_plots
from runtime.decode.engine import policy_key
from runtime.errors import ConfigError, EdgespecError
from runtime.serving.session import DRAFTER_CHOICES, GenerationParams, Session
from runtime.serving.tuning import machine_fingerprint, template_of, template_prefixes, write_tune
from runtime.speculation import Calibration, CostModel, best_depth, rate, speedup_over_plain

HELP = """Measure this machine and choose each drafter's draft depth from the measurements.

  verify cost: one target forward of n rows, n = 1 ... 64, at two context lengths, every cell once per round in
               a random order (plus a second 1-row cell, the control: its ratio to the first is the noise floor);
  drafters:    each drafter at its deepest shape (--k-max) on the bundle's planner / action / text prompts (or
               --prompts FILE), greedy and sampled: acceptance by depth and seconds of drafting per cycle;
  choice:      per drafter, template and temperature, the depth with the most expected tokens per second,
               0 = plain decoding where drafting cannot pay.

The tune is written to BUNDLE/tune.yaml for this backend, precision and machine; a tune from another machine is
reported, not used. Afterwards generate, bench and the ROS node draft adaptively (stats say
shape=adaptive (tuned)); --shape fixed (config drafter.shape) turns it off.

examples:
  edgespec tune --bundle build/bundles/zoo
  edgespec tune --bundle build/bundles/zoo --backend onnx --drafters draft_model,eagle3_chain --json
"""

NEWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def register(sub) -> None:
    p = sub.add_parser("tune", help="measure this machine and choose each drafter's draft shape (writes tune.yaml)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, drafter=False)
    p.add_argument("--drafters", help="comma-separated drafters to tune (default: every drafter the bundle has, "
                                      "and ngram)")
    p.add_argument("--prompts", metavar="FILE", help="your own prompts, one per line (default: the bundle's)")
    p.add_argument("--k-max", type=int, default=8, help="deepest draft tried, 1..32 (default 8)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the verify-cost grid (default 5)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per measuring request (default 48)")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--json", action="store_true", help="print the tune as one JSON object (with each drafter's "
                                                       "calibration: acceptance against confidence)")
    p.add_argument("--plot", metavar="DIR", help="also write PNGs into DIR (needs matplotlib): verify cost by rows, "
                                                 "acceptance vs confidence, expected vs measured tokens/s")
    p.set_defaults(func=run)


def verify_costs(target, contexts: Sequence[int], rounds: int) -> Tuple[List[Tuple[int, float]], float]:
    """[(rows, median seconds)] averaged over `contexts`, and the control ratio (second 1-row cell / first)."""
    room = target.max_cache_len - max(contexts) - 1
    news = [n for n in NEWS if n <= room]
    # each cell timed after a forward of its own shape: a plain step follows a plain step, and a tree of n nodes
    # mostly another of n; timed cold, a 1-row forward paid the switch from the cell before (~10 % on the zoo),
    # which made the first extra rows of a draft look free (c(4) = c(1)) and short drafts pay where they lose
    times = interleaved_grid([target], contexts, news, rounds, np.random.default_rng(0), settle=1)
    med = {key: float(np.median(v)) for key, v in times.items()}
    curve = [(n, float(np.mean([med[0, n, c] for c in contexts]))) for n in news]
    control = float(np.mean([med[0, CONTROL, c] / med[0, 1, c] for c in contexts]))
    target.keep(0, [])
    return curve, control


def conditional(acceptance_by_depth: Sequence[float]) -> List[float]:
    """P(depth d accepted | depth d-1 accepted) from P(accepted length >= d | drafted depth >= d).

    >>> conditional([0.8, 0.4, 0.2])
    [0.8, 0.5, 0.5]"""
    out, prev = [], 1.0
    for a in acceptance_by_depth:
        out.append(float(a) / prev if prev > 0 else 0.0)
        prev = float(a)
    return [round(min(1.0, x), 4) for x in out]


def measure_drafter(session: Session, prompts: List[str], temps: Sequence[float], max_tokens: int,
                    prefixes, calibrations: Optional[Dict[str, Calibration]] = None
                    ) -> Tuple[Dict[str, dict], float, float]:
    """Acceptance per template/temperature key, and (seconds of drafting per cycle, mean nodes drafted per cycle).
    `calibrations`, if given, gathers acceptance against confidence per temperature class (greedy / sampled)."""
    by_key: Dict[str, List] = {}
    draft_s = cycles = 0.0
    session.engine.record_confidence = calibrations is not None
    for t in temps:
        for i, prompt in enumerate(prompts):
            ids = session.tokenizer.encode(prompt)
            params = GenerationParams(max_tokens=max_tokens, temperature=t, seed=i)
            out = session.generate(prompt, params)
            s = out.stats
            key = policy_key(template_of(ids, prefixes), ids, params.sampling())  # the key the rule will look up
            by_key.setdefault(key, []).append((s.cycles, s.acceptance_by_depth, s.tokens, s.wall_s - s.prefill_s))
            if calibrations is not None and s.calibration:
                cls = key.rsplit("/", 1)[-1]  # greedy / sampled: what a confidence means differs between them
                calibrations.setdefault(cls, Calibration()).merge(Calibration.from_dict(s.calibration))
            draft_s += s.draft_s
            cycles += s.cycles
    result = {}
    for key, rows in by_key.items():
        depth = max(len(a) for _, a, _, _ in rows)
        acc = [sum(c * a[d] for c, a, _, _ in rows if d < len(a)) / max(1, sum(c for c, a, _, _ in rows if d < len(a)))
               for d in range(depth)]
        decode_s = sum(w for _, _, _, w in rows)
        result[key] = {"alphas": conditional(acc), "cycles": int(sum(c for c, _, _, _ in rows)),
                       "measured_tok_s": round(sum(n for _, _, n, _ in rows) / decode_s, 2) if decode_s > 0 else 0.0}
    return result, draft_s / max(cycles, 1.0), cycles


def run(args) -> int:
    t0 = time.perf_counter()
    cfg = runtime_config(args)
    if not 1 <= args.k_max <= 32:
        raise ConfigError(f"--k-max: got {args.k_max}, expected 1..32")
    if args.rounds < 1:
        raise ConfigError(f"--rounds: got {args.rounds}, expected >= 1")
    cfg = replace(cfg, drafter=replace(cfg.drafter, shape="fixed", branching=1))
    plain = Session(replace(cfg, drafter=replace(cfg.drafter, kind="none")))
    b = plain.bundle
    names = (split_list("--drafters", args.drafters, set(DRAFTER_CHOICES) | set(b.drafters)) if args.drafters
             else sorted(b.drafters) + ["ngram"])
    names = [n for n in dict.fromkeys(names) if n != "none"]
    if args.prompts:
        prompts = read_prompts(args.prompts)
    else:
        sets = bench_prompts(plain.prompts, [d for d in ("planner", "action", "text") if plain.prompts.has(d)])
        prompts = [p for ps in sets.values() for p in ps]
    prefixes = template_prefixes(plain.prompts, plain.tokenizer.encode)
    contexts = [c for c in (64, 256) if c + 65 < plain.target.max_cache_len] or [8]
    log(f"verify cost: {len(NEWS)} row counts x {len(contexts)} contexts x {args.rounds} rounds on {plain.backend_name}")
    curve, control = verify_costs(plain.target, contexts, args.rounds)
    backend, precision = plain.backend_name, plain.shape_precision
    plain.close()
    step = curve[0][1]
    log("verify / one step: " + ", ".join(f"{n}: {s / step:.2f}" for n, s in curve) + f"  (control {control:.2f})")
    drafters: Dict[str, dict] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        try:
            deep = Session(replace(cfg, drafter=replace(cfg.drafter, kind=name, num_tokens=args.k_max)))
        except EdgespecError as exc:
            skipped[name] = str(exc)
            log(f"{name}: skipped ({exc})")
            continue
        try:
            deep.generate(prompts[0], GenerationParams(max_tokens=4))  # warm-up
            calibrations: Dict[str, Calibration] = {}
            templates, per_cycle, _ = measure_drafter(deep, prompts, (0.0, 1.0), args.max_tokens, prefixes,
                                                      calibrations)
            nodes = float(np.mean([min(args.k_max, len(t["alphas"])) for t in templates.values()]))
        finally:
            deep.close()
        one = Session(replace(cfg, drafter=replace(cfg.drafter, kind=name, num_tokens=1)))
        try:
            _, per_cycle_1, _ = measure_drafter(one, prompts[:2], (0.0,), args.max_tokens, prefixes)
        finally:
            one.close()
        per_node = max(0.0, (per_cycle - per_cycle_1) / max(nodes - 1.0, 1.0))
        fixed = max(0.0, per_cycle_1 - per_node)
        cost = CostModel(tuple(curve), fixed, per_node)
        for key, t in templates.items():
            k = best_depth(t["alphas"], cost, args.k_max)
            t.update(k=k, speedup=round(speedup_over_plain(t["alphas"], cost, k), 3),
                     fixed4_speedup=round(speedup_over_plain(t["alphas"], cost, min(4, args.k_max)), 3),
                     expected_tok_s=round(rate(t["alphas"], cost, args.k_max), 2))  # the shape it measured
        drafters[name] = {"draft_fixed": fixed, "draft_per_node": per_node, "k_max": args.k_max,
                          "templates": templates, "calibration": {c: t.to_dict() for c, t in calibrations.items()}}
        log(f"{name}: drafting {fixed * 1e3:.2f} ms + {per_node * 1e3:.2f} ms/node; " + "; ".join(
            f"{key} k={t['k']} (x{t['speedup']:.2f}, fixed 4: x{t['fixed4_speedup']:.2f})" for key, t in templates.items()))
    entry = {"backend": backend, "precision": precision, "machine": machine_fingerprint(),
             "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "seconds": round(time.perf_counter() - t0, 1), "control": round(control, 3),
             "verify": [[n, s] for n, s in curve], "drafters": drafters, "skipped": skipped}
    path = None if args.dry_run else write_tune(cfg.bundle, entry)
    plots = write_tune_plots(entry, args.plot) if args.plot else []
    if args.json:
        print(json.dumps(entry))
    else:
        print_tune(entry)
        print(f"tune: {'not written (--dry-run)' if path is None else 'wrote ' + path} after {entry['seconds']:.0f} s")
    for p in plots:
        log(f"wrote {p}")
    return 0


def print_tune(entry: dict) -> None:
    print(f"{'drafter':<14} {'template/temperature':<22} {'alpha by depth':<34} {'k':>2} {'expected':>9} {'fixed 4':>8}")
    for name, d in entry["drafters"].items():
        for key, t in d["templates"].items():
            alphas = " ".join(f"{a:.2f}" for a in t["alphas"][:8])
            print(f"{name:<14} {key:<22} {alphas:<34} {t['k']:>2} {t['speedup']:>8.2f}x {t['fixed4_speedup']:>7.2f}x")
    for name, why in entry["skipped"].items():
        print(f"{name:<14} skipped: {why}")


def log(text: str) -> None:
    print(f"tune: {text}", file=sys.stderr, flush=True)
