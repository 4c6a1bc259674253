"""`edgespec zoo plans`: does the zoo planner write plans a robot can run, with and without the plan schema
(configs/plan_schema.json enforced while decoding, runtime/text/grammar.py)?

On the held-out planner prompts (the zoo's own split) and on OUT_OF_DISTRIBUTION instructions (written by
hand, phrased unlike the generator), each prompt is decoded greedily under four configurations run back to
back in one process, the order rotated from prompt to prompt: plain and speculative decoding (the same
drafter, the same backend), each free and under the schema. Reported per configuration:
  valid   parse_plan accepts the text AND it validates against the schema (jsonschema, independent of the
          grammar engine);
  exact   the plan equals the held-out reference plan (held-out prompts only);
  tau, tokens/s, and the speedup over plain decoding with the same grammar setting: tok/s ratios over
          blocks of BLOCK consecutive prompts (paired: both ran the same prompts back to back), median and min-max;
          a second plain-decoding session (the control) is measured like a drafter, so its spread is the noise
          floor of the run;
  grammar share: grammar_s / (wall_s - prefill_s), the time spent computing masks per decoded second.

    edgespec zoo plans --n 200 --drafter draft_model
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

# Hand-written, unlike the generator's templates: other verbs, politeness, indirect requests, words the
# generator never uses (glasses, stapler, nightstand, milk ...). A planner must still return a runnable plan.
OUT_OF_DISTRIBUTION = [
    "Could you grab my reading glasses off the nightstand in the bedroom and bring them over here?",
    "I'm thirsty. A bottle of water from the fridge would be great.",
    "Tidy up: the dirty mugs on the office desk go into the dishwasher.",
    "Check whether the back door in the garage is locked.",
    "Hand Grace the stapler that is lying around in the lab.",
    "Go to the hallway and stay there for half a minute.",
    "The cat knocked over a plant in the living room, take a look at it.",
    "Fetch an apple from the kitchen for Bob, who is sitting in the dining room.",
    "Empty the toolbox in the workshop onto the workbench.",
    "Bring the remote control that is on the sofa to me",
    "Milk goes in the fridge, please put it away.",
    "Open the bedroom window, it is stuffy in there.",
    "Would you mind moving the laundry basket from the bathroom to the laundry room?",
    "Find my phone, I think I left it somewhere in the office.",
    "Give Heidi a towel out of the bathroom cupboard.",
    "Shut the microwave in the kitchen.",
    "Carry the heavy box out of the storage room and leave it by the front door.",
    "Hold on for a moment, then bring me a spoon.",
    "Inspect the printer in the office, it keeps jamming.",
    "Take the charger off the counter and put it next to the bed.",
]

CONTROL = "none (control)"  # plain decoding measured again, like a drafter: the noise floor
BLOCK = 10  # prompts per paired speedup ratio

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "configs", "plan_schema.json")


def heldout_prompts(n: int, zoo: Optional[str] = None) -> List[tuple]:
    """(instruction, context, reference plan) of the first n held-out planner examples of the zoo's split."""
    import yaml

    from export.zoo.planner_data import split_planner
    from export.zoo.train import DEFAULT_OUT

    with open(os.path.join(zoo or DEFAULT_OUT, "MANIFEST.yaml")) as f:
        bc = yaml.safe_load(f)["build_config"]
    _, held = split_planner(bc["seed"], bc["n_planner"], max(n, 1))
    return [(e.instruction, e.context, list(e.plan)) for e in held[:n]]


def valid_plan(text: str, validator) -> bool:
    from runtime.errors import RequestError
    from runtime.text.prompts import parse_plan

    try:
        steps = parse_plan(text)
    except RequestError:
        return False
    return validator is None or validator.is_valid(steps)


def schema_validator(schema: dict):
    try:
        import jsonschema
    except ImportError:  # the test extra installs it; without it `valid` is parse_plan alone
        print("zoo plans: jsonschema is not installed; 'valid' means parse_plan only", file=sys.stderr)
        return None
    return jsonschema.Draft202012Validator(schema)


def measure(session_factory, prompts: List[tuple], schema: dict, drafter: str, progress=None):
    """Run every prompt under the four configurations; returns (per-configuration rows of every prompt, backend)."""
    from runtime.text.prompts import parse_plan
    from runtime.serving.session import GenerationParams

    sessions = {"none": session_factory("none"), CONTROL: session_factory("none"), drafter: session_factory(drafter)}
    configs = [(d, g) for d in ("none", CONTROL, drafter) for g in (False, True)]
    params = GenerationParams(max_tokens=160)
    validator = schema_validator(schema)
    rows: Dict[tuple, List[dict]] = {c: [] for c in configs}
    for s in sessions.values():  # warm-up: caches, allocations, the compiled schema
        s.plan("bring the cup", params=replace(params, max_tokens=4), schema=schema)
    for i, (instruction, context, ref) in enumerate(prompts):
        k = i % len(configs)
        for d, g in configs[k:] + configs[:k]:
            res = sessions[d].plan(instruction, context, params, schema=schema if g else None)
            st = res.stats
            exact = None
            if ref is not None:
                try:
                    exact = parse_plan(res.text) == ref
                except Exception:
                    exact = False
            rows[d, g].append({"valid": valid_plan(res.text, validator), "exact": exact, "tokens": st.tokens,
                               "wall_s": st.wall_s, "prefill_s": st.prefill_s, "cycles": st.cycles,
                               "tau": st.tau, "grammar_s": st.grammar_s, "text": res.text,
                               "finish": res.finish_reason})
        if progress:
            progress(i + 1, len(prompts))
    backend = sessions[drafter].backend_name
    for s in sessions.values():
        s.close()
    return rows, backend


def block_ratios(rs: List[dict], base: List[dict], block: int) -> List[float]:
    """tok/s of rs over tok/s of base on each block of `block` consecutive prompts (the last block may be short)."""
    out = []
    for i in range(0, len(rs), block):
        a, b = rs[i:i + block], base[i:i + block]
        out.append((sum(r["tokens"] for r in a) / sum(r["wall_s"] for r in a))
                   / (sum(r["tokens"] for r in b) / sum(r["wall_s"] for r in b)))
    return out


def summarise(rows: Dict[tuple, List[dict]], drafter: str) -> List[dict]:
    table = []
    for (d, g), rs in rows.items():
        ratios = block_ratios(rs, rows["none", g], BLOCK)
        ex = [r["exact"] for r in rs if r["exact"] is not None]
        decode_s = sum(r["wall_s"] - r["prefill_s"] for r in rs)
        cycles = sum(r["cycles"] for r in rs)
        table.append({
            "drafter": d, "grammar": g, "control": d == CONTROL, "prompts": len(rs),
            "valid_rate": sum(r["valid"] for r in rs) / len(rs),
            "exact_rate": sum(ex) / len(ex) if ex else None,
            "tau": sum(r["tau"] * r["cycles"] for r in rs) / cycles if cycles else None,
            "tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs),
            "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "grammar_ms_per_cycle": 1e3 * sum(r["grammar_s"] for r in rs) / cycles if cycles else None,
            "grammar_share": sum(r["grammar_s"] for r in rs) / decode_s if decode_s > 0 else 0.0,
            "invalid_examples": [r["text"][:160] for r in rs if not r["valid"]][:3],
        })
    return table


def run(args) -> int:
    from runtime.commands.common import runtime_config
    from runtime.serving.session import Session

    with open(SCHEMA_PATH) as f:
        schema = json.load(f)
    cfg = runtime_config(args)

    def factory(kind: str):
        return Session(replace(cfg, drafter=replace(cfg.drafter, kind=kind)))

    drafter = args.drafter or "draft_model"
    t0 = time.perf_counter()
    sets = {"heldout": heldout_prompts(args.n, args.zoo),
            "out_of_distribution": [(s, "", None) for s in OUT_OF_DISTRIBUTION]}
    report = {}
    for name, prompts in sets.items():
        def progress(done, total, name=name):
            if done % 10 == 0 or done == total:
                print(f"zoo plans: {name} {done}/{total}, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        rows, backend = measure(factory, prompts, schema, drafter, progress)
        report[name] = summarise(rows, drafter)
    if args.json:
        print(json.dumps(report))
        return 0
    for name, table in report.items():
        print(f"\n{name} ({table[0]['prompts']} prompts, greedy, backend {backend})")
        print(f"{'drafter':<15} {'schema':<7} {'valid':>7} {'exact':>7} {'tau':>6} {'tok/s':>7} "
              f"{'speedup [min-max]':>20} {'grammar ms/cycle':>17} {'grammar share':>14}")
        for r in table:
            exact = f"{100 * r['exact_rate']:.1f}%" if r["exact_rate"] is not None else "-"
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            gms = f"{r['grammar_ms_per_cycle']:.2f}" if r["grammar_ms_per_cycle"] is not None else "-"
            print(f"{r['drafter']:<15} {'yes' if r['grammar'] else 'no':<7} {100 * r['valid_rate']:>6.1f}% {exact:>7} "
                  f"{tau:>6} {r['tokens_per_s']:>7.1f} {r['speedup']:>6.2f}x [{r['speedup_min']:.2f}-"
                  f"{r['speedup_max']:.2f}] {gms:>17} {100 * r['grammar_share']:>13.1f}%")
            for ex in r["invalid_examples"]:
                print(f"    invalid: {ex}")
    return 0
