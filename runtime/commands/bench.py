"""`edgespec bench`: plain decoding and each drafter measured side by side in one run, on the same
backend and prompts: speedup, tau, time per cycle split into draft / verify / other, memory, and
whether greedy output stayed token-identical to plain decoding.

Measurements are paired, because this kind of machine is shared and its speed drifts (sequential runs
of one drafter gave 1.27x, 0.76x and 2.24x): every round runs each prompt under every configuration
back to back (none, ngram, ..., none again; the order rotated from prompt to prompt, so that no
configuration always runs first, after another one's weights went through the caches), a configuration's speedup in a round is its tok/s over
plain decoding's in that round, and the table reports the median of those per-round ratios with their
min-max. The second plain-decoding configuration, the control, is measured exactly like a drafter: its
ratio to the first would be 1.00 on a quiet machine, so its spread is the noise floor of the run.

Example, 3 rounds: none 40, 38, 20 tok/s; draft_model 80, 84, 30 tok/s -> ratios 2.0, 2.2, 1.5 ->
speedup 2.0x [1.5-2.2] (the slow third round, a busy neighbour, hurt both and cancels in the ratio)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from runtime import bundle as bundle_io
from runtime.commands.common import add_model_args, runtime_config
from runtime.errors import ConfigError
from runtime.prompts import action_prompt, planner_prompt, text_prompt
from runtime.session import DRAFTER_CHOICES, GenerationParams, Session

HELP = """Benchmark plain decoding against speculative drafters on the same backend, in one run.

examples:
  edgespec bench --drafters none,ngram,draft_model --max-tokens 64
  edgespec bench --bundle build/bundles/zoo-standin --drafters none,ngram,draft_model,mtp --temperatures 0,1 --rounds 5
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


CONTROL = "none (control)"  # plain decoding measured a second time, as if it were a drafter


def register(sub) -> None:
    p = sub.add_parser("bench", help="speedup of each drafter over plain decoding, measured side by side",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, drafter=False)  # bench compares drafters: --drafters names them all
    p.add_argument("--drafters", default="none,ngram,draft_model",
                   help="comma-separated drafters to compare (default none,ngram,draft_model); 'none' (plain "
                        "decoding) is always run as the baseline, and again as the control row")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt, >= 1 (default 64)")
    p.add_argument("--domains", default=",".join(BENCH_PROMPTS),
                   help=f"comma-separated prompt sets to run, of {', '.join(BENCH_PROMPTS)} (default all)")
    p.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3,
                   help="interleaved rounds, >= 1 (default 3): each round runs every prompt under every "
                        "configuration back to back; the speedup is the median of the per-round ratios")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated sampling temperatures, each >= 0 (default 0 = greedy); every "
                        "configuration runs at each")
    p.add_argument("--seed", type=int, help="RNG seed for sampling, >= 0 (default 0); round r, prompt i use seed + "
                                            "1000 r + i in every configuration")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows instead of the table")
    p.set_defaults(func=run)


def split_list(flag: str, text: str, known) -> List[str]:
    """The names of a comma-separated flag, each one of `known`, or a ConfigError naming the flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ConfigError(f"{flag}: got {text!r}, expected a comma-separated list of {sorted(known)}")
    return names


def parse_temperatures(text: str) -> List[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        temps = []
    if not temps or any(not (0.0 <= t <= 100.0) for t in temps):  # also refuses nan
        raise ConfigError(f"--temperatures: got {text!r}, expected a comma-separated list of numbers in [0, 100]")
    return temps


@dataclass
class Tally:
    """One configuration at one temperature: totals over all rounds, and tok/s of each round."""
    round_tokens: List[int] = field(default_factory=list)  # (rounds,)
    round_wall: List[float] = field(default_factory=list)  # (rounds,) seconds
    cycles: int = 0
    tau_sum: float = 0.0
    requests: int = 0
    prefix_tokens: int = 0  # prompt tokens whose K/V the prefix cache kept
    prompt_tokens: int = 0
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    outputs: List[List[int]] = field(default_factory=list)  # token ids of every (round, prompt)

    def add(self, r: int, res) -> None:
        s = res.stats
        if len(self.round_tokens) <= r:
            self.round_tokens.append(0)
            self.round_wall.append(0.0)
        self.round_tokens[r] += s.tokens
        self.round_wall[r] += s.wall_s
        self.cycles += s.cycles
        self.tau_sum += s.tau * s.cycles
        self.requests += 1
        self.prefix_tokens += s.prefix_tokens
        self.prompt_tokens += s.prefix_tokens + s.prefill_tokens
        self.prefill += s.prefill_s
        self.draft += s.draft_s
        self.verify += s.verify_s
        self.other += s.other_s
        self.outputs.append(list(res.token_ids))

    def round_tps(self) -> List[float]:
        return [t / w for t, w in zip(self.round_tokens, self.round_wall)]


def paired_speedup(tps: List[float], base_tps: List[float]) -> Dict[str, object]:
    """Median, min and max of the per-round ratios tps[r] / base_tps[r].

    >>> paired_speedup([80, 84, 30], [40, 38, 20])["speedup"]
    2.0"""
    ratios = [a / b for a, b in zip(tps, base_tps)]
    return {"speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "speedup_per_round": ratios}


def row(label: str, drafter: str, temp: float, t: Tally, base: Tally, session, bundle_name: str) -> Dict[str, object]:
    cyc = max(t.cycles, 1)
    decode_wall = sum(t.round_wall) - t.prefill
    greedy = temp == 0.0
    return {
        "drafter": drafter, "label": label, "control": label == CONTROL, "temperature": temp,
        "bundle": bundle_name, "standin": "standin" in bundle_name.lower(), "backend": session.backend_name,
        "rounds": len(t.round_tps()), "tokens": sum(t.round_tokens),
        "tokens_per_s": statistics.median(t.round_tps()), **paired_speedup(t.round_tps(), base.round_tps()),
        "tau": t.tau_sum / cyc if t.cycles else 1.0,
        "ms_per_cycle": 1e3 * decode_wall / cyc, "draft_ms": 1e3 * t.draft / cyc,
        "verify_ms": 1e3 * t.verify / cyc, "other_ms": 1e3 * t.other / cyc,
        "ttft_ms": 1e3 * t.prefill / max(t.requests, 1),  # mean time to first token (= prefill) per request
        "prefix_reused": t.prefix_tokens / max(t.prompt_tokens, 1),  # share of prompt tokens the prefix cache kept
        "memory_mib": session.memory_in_use() / 2**20,
        # sampled outputs legitimately differ between drafters (each consumes the RNG its own way)
        "identical_to_plain": t.outputs == base.outputs if greedy else None,
    }


def run(args) -> int:
    cfg = runtime_config(args)
    if args.rounds < 1:
        raise ConfigError(f"--rounds: got {args.rounds}, expected >= 1")
    temps = parse_temperatures(args.temperatures)
    domains = split_list("--domains", args.domains, BENCH_PROMPTS)
    bundle = bundle_io.load(cfg.bundle, verify_checksums=False)  # the names are checked before anything runs
    names = split_list("--drafters", args.drafters, set(DRAFTER_CHOICES) | set(bundle.drafters))
    names = ["none"] + [n for n in dict.fromkeys(names) if n != "none"]
    configs = {n: n for n in names}
    configs[CONTROL] = "none"
    prompts = [p for d in domains for p in BENCH_PROMPTS[d]]
    sessions = {label: Session(replace(cfg, drafter=replace(cfg.drafter, kind=kind))) for label, kind in configs.items()}
    try:
        for s in sessions.values():
            s.generate(prompts[0], GenerationParams(max_tokens=4))  # warm-up (caches, allocations)
        tallies = {(label, t): Tally() for label in configs for t in temps}
        labels = list(configs)
        start = time.perf_counter()
        for r in range(args.rounds):
            for t in temps:
                for i, prompt in enumerate(prompts):
                    params = GenerationParams(max_tokens=cfg.generation.max_tokens, temperature=t,
                                              seed=cfg.generation.seed + 1000 * r + i)
                    k = (r * len(prompts) + i) % len(labels)  # rotated, so no configuration always runs first
                    for label in labels[k:] + labels[:k]:  # back to back: A B C, B C A, ...
                        tallies[label, t].add(r, sessions[label].generate(prompt, params))
            done = time.perf_counter() - start
            print(f"bench: round {r + 1}/{args.rounds} done, {done:.0f} s, ETA {done / (r + 1) * (args.rounds - r - 1):.0f} s",
                  file=sys.stderr, flush=True)
        table = [row(label, kind, t, tallies[label, t], tallies["none", t], sessions[label], bundle.name)
                 for t in temps for label, kind in configs.items()]
    finally:
        for s in sessions.values():
            s.close()
    if args.json:
        print(json.dumps(table))
    else:
        print_table(table, bundle.name, prompts, domains, cfg, args.rounds)
    return 0 if all(t["identical_to_plain"] is not False for t in table) else 1


def print_table(table: List[Dict[str, object]], bundle_name: str, prompts, domains, cfg, rounds: int) -> None:
    standin = table[0]["standin"]
    print(f"bench: bundle {bundle_name}{' (STAND-IN: zero-padded zoo target; predicts like it, costs like a wider model)' if standin else ''}, "
          f"{len(prompts)} prompts ({','.join(domains)}), max_tokens={cfg.generation.max_tokens}, "
          f"backend={table[0]['backend']}, {rounds} interleaved rounds; speedup = median of per-round tok/s ratios "
          "to 'none' [min-max]")
    print(f"{'drafter':17s} {'T':>4s} {'tok/s':>7s} {'speedup':>8s} {'[min-max]':>12s} {'tau':>5s} {'ms/cycle':>9s} "
          f"{'draft':>7s} {'verify':>7s} {'other':>7s} {'TTFT ms':>8s} {'MiB':>6s}  identical")
    for t in table:
        label = t["label"] + (" *" if standin else "")
        ident = {True: "yes", False: "NO", None: "n/a"}[t["identical_to_plain"]]
        print(f"{label:17s} {t['temperature']:4.1f} {t['tokens_per_s']:7.1f} {t['speedup']:7.2f}x "
              f"{'[' + format(t['speedup_min'], '.2f') + '-' + format(t['speedup_max'], '.2f') + ']':>12s} "
              f"{t['tau']:5.2f} {t['ms_per_cycle']:9.2f} {t['draft_ms']:7.2f} {t['verify_ms']:7.2f} "
              f"{t['other_ms']:7.2f} {t['ttft_ms']:8.2f} {t['memory_mib']:6.1f}  {ident}")
    if standin:
        print("* stand-in rows: the target is the zoo target widened with zero weights (edgespec zoo standin); tau is "
              "the zoo's, tok/s is a wider model's")
    print(f"'{CONTROL}' is plain decoding measured again like a drafter: its spread is this run's noise; TTFT: mean "
          f"prefill per request, the prefix cache keeping {table[0]['prefix_reused']:.0%} of prompt tokens "
          f"(memory.prefix_cache: {cfg.memory.prefix_cache})")
