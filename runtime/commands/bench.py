"""`edgespec bench`: plain decoding and each drafter measured side by side in one run, on the same
backend and prompts: speedup, tau, time per cycle split into draft / verify / other, memory, and
whether greedy output stayed token-identical to plain decoding."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Dict, List

from runtime import bundle as bundle_io
from runtime.commands.common import add_model_args, runtime_config
from runtime.errors import ConfigError
from runtime.prompts import action_prompt, planner_prompt, text_prompt
from runtime.session import DRAFTER_CHOICES, GenerationParams, Session

HELP = """Benchmark plain decoding against speculative drafters on the same backend, in one run.

example:
  edgespec bench --drafters none,ngram,draft_model --max-tokens 64
"""

# In the zoo's own vocabulary (rooms, objects, people its generators use), but not from its training set.
BENCH_PROMPTS = {
    "planner": [planner_prompt(s) for s in (
        "take the white hammer from the bathroom to Eve in the kitchen",
        "store the screwdriver from the living room in the cabinet, then put the apple from the laundry room on the bed",
        "give the red box from the workshop to Carol in the bedroom",
        "take the plastic toy out of the fridge in the office and put it on the sink",
    )],
    "action": [action_prompt(s, o) for s, o in (
        ("put down the white charger on the tray", [0.24, 0.23, 0.27, 0.39, 0.0, 0.38, 0.28, 0.02]),
        ("lift the metal apple", [0.30, -0.26, 0.11, -0.03, 0.0, 0.30, -0.26, 0.05]),
    )],
    "text": [text_prompt(s) for s in ("To be, or not to be", "Now is the winter of our discontent")],
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="speedup of each drafter over plain decoding, measured side by side",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, drafter=False)  # bench compares drafters: --drafters names them all
    p.add_argument("--drafters", default="none,ngram,draft_model",
                   help="comma-separated drafters to compare (default none,ngram,draft_model); 'none' (plain "
                        "decoding) is always run as the baseline")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt, >= 1 (default 64)")
    p.add_argument("--domains", default=",".join(BENCH_PROMPTS),
                   help=f"comma-separated prompt sets to run, of {', '.join(BENCH_PROMPTS)} (default all)")
    p.add_argument("--repeats", type=int, default=1, help="runs per prompt, >= 1 (the best wall time is kept)")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    p.set_defaults(func=run)


def split_list(flag: str, text: str, known) -> List[str]:
    """The names of a comma-separated flag, each one of `known`, or a ConfigError naming the flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ConfigError(f"{flag}: got {text!r}, expected a comma-separated list of {sorted(known)}")
    return names


def run_drafter(cfg, args, drafter: str, prompts: List[str]) -> Dict[str, object]:
    session = Session(replace(cfg, drafter=replace(cfg.drafter, kind=drafter)))
    params = GenerationParams(max_tokens=cfg.generation.max_tokens)
    agg = dict(tokens=0, wall=0.0, cycles=0, forwards=0, draft=0.0, verify=0.0, other=0.0, prefill=0.0, tau_sum=0.0)
    outputs = []
    session.generate(prompts[0], replace(params, max_tokens=4))  # warm-up (caches, allocations)
    for prompt in prompts:
        best = None
        for _ in range(args.repeats):
            res = session.generate(prompt, params)
            if best is None or res.stats.wall_s < best.stats.wall_s:
                best = res
        s = best.stats
        outputs.append(best.token_ids)
        agg["tokens"] += s.tokens
        agg["wall"] += s.wall_s
        agg["cycles"] += s.cycles
        agg["tau_sum"] += s.tau * s.cycles
        agg["forwards"] += s.target_forwards
        agg["draft"] += s.draft_s
        agg["verify"] += s.verify_s
        agg["other"] += s.other_s
        agg["prefill"] += s.prefill_s
    agg["memory_mib"] = session.memory_in_use() / 2**20
    agg["outputs"] = outputs
    agg["backend"] = session.backend_name
    return agg


def run(args) -> int:
    cfg = runtime_config(args)
    if args.repeats < 1:
        raise ConfigError(f"--repeats: got {args.repeats}, expected >= 1")
    domains = split_list("--domains", args.domains, BENCH_PROMPTS)
    bundle = bundle_io.load(cfg.bundle, verify_checksums=False)  # the names are checked before anything runs
    names = split_list("--drafters", args.drafters, set(DRAFTER_CHOICES) | set(bundle.drafters))
    if "none" not in names:
        names.insert(0, "none")
    prompts = [p for d in domains for p in BENCH_PROMPTS[d]]
    rows = {name: run_drafter(cfg, args, name, prompts) for name in names}
    base = rows["none"]
    base_tps = base["tokens"] / base["wall"]
    table = []
    for name, r in rows.items():
        decode_wall = r["wall"] - r["prefill"]
        cyc = max(r["cycles"], 1)
        table.append({
            "drafter": name, "backend": r["backend"], "tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["wall"],
            "speedup": (r["tokens"] / r["wall"]) / base_tps,
            "tau": r["tau_sum"] / cyc,
            "ms_per_cycle": 1e3 * decode_wall / cyc, "draft_ms": 1e3 * r["draft"] / cyc,
            "verify_ms": 1e3 * r["verify"] / cyc, "other_ms": 1e3 * r["other"] / cyc,
            "memory_mib": r["memory_mib"], "identical_to_plain": r["outputs"] == base["outputs"],
        })
    if args.json:
        print(json.dumps(table))
        return 0
    print(f"bench: {len(prompts)} prompts ({','.join(domains)}), greedy, max_tokens={cfg.generation.max_tokens}, "
          f"backend={base['backend']}")
    print(f"{'drafter':12s} {'tok/s':>7s} {'speedup':>8s} {'tau':>5s} {'ms/cycle':>9s} {'draft':>7s} {'verify':>7s} "
          f"{'other':>7s} {'MiB':>6s}  identical")
    for t in table:
        print(f"{t['drafter']:12s} {t['tokens_per_s']:7.1f} {t['speedup']:7.2f}x {t['tau']:5.2f} {t['ms_per_cycle']:9.2f} "
              f"{t['draft_ms']:7.2f} {t['verify_ms']:7.2f} {t['other_ms']:7.2f} {t['memory_mib']:6.1f}  "
              f"{'yes' if t['identical_to_plain'] else 'NO'}")
    return 0 if all(t["identical_to_plain"] for t in table) else 1
