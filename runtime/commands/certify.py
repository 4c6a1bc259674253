"""`edgespec certify`: the statistical exactness test, run on the robot's own bundle and backend."""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import List, Tuple

from runtime.certify.run import LOSSY_REFUSAL, certify, choose_contexts, dedup_siblings, forget_residual
from runtime.commands.common import add_model_args, runtime_config
from runtime.errors import ConfigError
from runtime.text.prompts import format_observation
from runtime.sampling import SamplingParams
from runtime.serving.session import Session
from runtime.text.templates import PromptFormat

HELP = """Prove on this machine that speculative decoding leaves the target's distribution unchanged.

For each context the real engine (drafter + verification + backend) is run DRAWS times from the same
state; the first emitted token and the first two emitted tokens are compared with the exact target
distribution (enumerated) by a chi-square goodness-of-fit test. PASS means p-value >= alpha for both.

Contexts are chosen where a wrong rule would show: a deterministic search over planner, text and action
continuations scores each position by how far a wrong rule would move the emitted law there (the drafter's
q peaked and different from p) and keeps the best per domain, plus the best whose next token is
near-certain. Drafters that build trees are tested as chains and as trees (--trees). Each configuration
also runs a POWER CONTROL: the same test with a wrong rule swapped in (dropping duplicate siblings for
trees, sampling p instead of the residual for chains), which must FAIL; if it does not, the test had no
power in these contexts and the verdict is INCONCLUSIVE.

A draw costs about 5-20 ms on the zoo bundle here (the models' outputs are memoised by token path), so the
defaults (6 contexts x 10000 draws, chain + two tree widths, each with its control) take a while; a good
drafter leaves a wrong tree rule little room to show, and trees may need 20000 draws for the control to fail.

example:
  edgespec certify --drafter draft_model --temperature 0.8 --draws 20000
"""

# (domain, task, request values) the context search starts from, rendered in the bundle's prompt format.
SEED_REQUESTS = [("planner", "planner", {"instruction": s, "context": ""}) for s in (
    "give the red box from the workshop to Carol in the bedroom",
    "bring two apples from the kitchen to the office",
    "open the fridge and put the milk on the table",
    "pick up the blue mug in the kitchen and hand it to Dave",
    "put three forks in the drawer",
    "close the cabinet in the bathroom")] + [
    ("text", "text", {"text": "To be, or not to be"}),
    ("action", "action", {"instruction": "lift the metal apple",
                          "observation": format_observation([0.30, -0.26, 0.11, -0.03, 0.0, 0.30, -0.26, 0.05])}),
]


def seeds(fmt: PromptFormat) -> List[Tuple[str, str]]:
    """(domain, prompt text) of every seed request the prompt format has a template for."""
    return [(domain, fmt.render(task, **values)) for domain, task, values in SEED_REQUESTS if fmt.has(task)]


MIN_USEFUL_DRAWS = 1000


def register(sub) -> None:
    p = sub.add_parser("certify", help="statistical proof that speculative sampling is exact, on this bundle/backend",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature to certify (> 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to certify, in (0, 1] (1 = off)")
    p.add_argument("--draws", type=int, default=10000, help="independent draws per context (default 10000)")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level, in (0, 0.5) (default 0.001)")
    p.add_argument("--context", action="append",
                   help="a context to test (repeatable); default: searched in the planner, text and action domains")
    p.add_argument("--trees", default="auto",
                   help="branchings to test besides the configured one, e.g. 2,3; 'auto' = 2,3 for drafters that "
                        "build sampled trees; 'none' = only the configured one")
    p.add_argument("--no-control", action="store_true", help="skip the power control (halves the time)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the draws (fixed: a rerun draws the same)")
    p.set_defaults(func=run)


def check_args(args) -> None:
    """Refuse what would make the test meaningless, naming the flag, the value and the range."""
    t = args.temperature
    if not (math.isfinite(t) and t > 0):
        raise ConfigError(f"--temperature: got {t!r}, expected a finite number > 0 (certify tests sampling; "
                          "greedy identity is checked by `edgespec bench`)")
    if not (0.0 < args.top_p <= 1.0):
        raise ConfigError(f"--top-p: got {args.top_p!r}, expected a number in (0, 1]")
    if not (0.0 < args.alpha < 0.5):
        raise ConfigError(f"--alpha: got {args.alpha!r}, expected a significance level in (0, 0.5), e.g. 0.001")
    if args.draws < 1:
        raise ConfigError(f"--draws: got {args.draws}, expected an integer >= 1 (>= {MIN_USEFUL_DRAWS} for power)")


def tree_widths(arg: str, configured: int, drafter) -> List[int]:
    if drafter.fixed_shape:  # e.g. Medusa: the tree is its choice list, tested as it is
        if arg not in ("auto", "none"):
            raise ConfigError(f"--trees: the drafter {drafter.kind!r} drafts the tree its own data gives (widest node "
                              f"{drafter.branching}); use --trees auto")
        return [drafter.branching]
    if arg == "none":
        extra: List[int] = []
    elif arg == "auto":
        extra = [2, 3] if drafter.builds_sampled_trees else []
    else:
        try:
            extra = [int(x) for x in arg.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--trees: got {arg!r}, expected 'auto', 'none' or branchings like 2,3") from None
        if any(not 1 <= b <= 16 for b in extra):
            raise ConfigError(f"--trees: got {arg!r}, each branching must be in 1..16")
        if extra and not drafter.takes_branching:
            raise ConfigError(f"--trees: the drafter {drafter.kind!r} does not build trees; "
                              "use --trees none")
    return sorted({configured, *extra})


def run(args) -> int:
    check_args(args)
    cfg = runtime_config(args)
    if cfg.decoding.lossy_typical_acceptance:
        raise ConfigError(LOSSY_REFUSAL)
    session = Session(cfg)
    if session.drafter is None:
        raise ConfigError("--drafter: certify needs a drafter (plain decoding has nothing to certify); "
                          "pick one of the bundle's, e.g. --drafter draft_model")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    params.validate(session.target.spec.vocab_size)
    widths = tree_widths(args.trees, session.config.drafter.branching, session.drafter)
    print(f"certify: bundle={session.config.bundle} backend={session.backend_name} drafter={session.drafter_kind} "
          f"temperature={args.temperature} top_p={args.top_p} draws={args.draws} alpha={args.alpha} "
          f"branchings={','.join(map(str, widths))}")
    if args.draws < MIN_USEFUL_DRAWS:
        print(f"certify: WARNING: {args.draws} draws per context give the test almost no power; a PASS means "
              f"little (use >= {MIN_USEFUL_DRAWS}, default 10000)", file=sys.stderr)
    verdicts = [run_configuration(session, args, params, b) for b in widths]
    line, code = final_verdict(verdicts, control_run=not args.no_control)
    print(line)
    return code


def final_verdict(verdicts: List[str], control_run: bool) -> Tuple[str, int]:
    """(the closing line, the exit code) of the run's configurations' verdicts (PASS / FAIL / INCONCLUSIVE)."""
    if "FAIL" in verdicts:
        return "certify: FAIL — the emitted distribution differs from the target's; do not deploy this drafter", 1
    if "INCONCLUSIVE" in verdicts:
        return ("certify: INCONCLUSIVE — no evidence of a difference, but a known-wrong rule was not detected either "
                "in these contexts; raise --draws or give --context where the drafter is confidently wrong"), 2
    if not control_run:
        return ("certify: PASS — no evidence that speculative decoding changes the target distribution; no power "
                "control was run (--no-control), so this does not show the test would have seen a wrong rule"), 0
    return ("certify: PASS — no evidence that speculative decoding changes the target distribution, and the power "
            "control shows the test would have seen a wrong rule"), 0


class DrawProgress:
    """Progress lines on stderr while draws run (a chain of 6 x 10000 draws takes minutes): one line when
    `every_s` seconds have passed since the last, so a short run prints none. stdout (the verdicts) is untouched."""

    def __init__(self, what: str, every_s: float = 10.0, clock=time.monotonic, out=None):
        self.what = what
        self.every_s = every_s
        self.clock = clock
        self.out = out
        self.start = self.last = clock()

    def __call__(self, context: int, contexts: int, done: int, draws: int) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        print(f"certify: {self.what}: context {context + 1}/{contexts}, draw {done}/{draws}, "
              f"{now - self.start:.0f} s", file=self.out or sys.stderr, flush=True)


def run_configuration(session, args, params: SamplingParams, width: int) -> str:
    drafter = session.drafter
    if drafter.fixed_shape:
        shape = f"its own tree (widest node {width})"
    else:
        if drafter.takes_branching:
            drafter.set_branching(width)
        shape = "chain" if width == 1 else f"tree, branching {width}"
    t0 = time.perf_counter()
    if args.context:
        contexts = list(args.context)
    else:
        contexts = choose_contexts(session, seeds(session.prompts), params, horizon=40, rollouts=3)
    print(f"\n== {shape}: {len(contexts)} contexts"
          + ("" if args.context else f" (searched in {time.perf_counter() - t0:.1f} s)"))
    print(f"{'context':64s} {'draws':>6s} {'p(t1)':>8s} {'p(t1,t2)':>9s} {'tau':>5s}  verdict")
    results = certify(session, contexts, params, draws=args.draws, alpha=args.alpha, seed=args.seed, progress=_show,
                      on_draw=DrawProgress(shape))
    passed = all(r.passed for r in results)
    if args.no_control:
        return "PASS" if passed else "FAIL"
    control, rule, verifier = (("drop duplicate siblings", dedup_siblings, None) if width > 1 else
                               ("sample p instead of the residual", None, forget_residual))
    print(f"-- power control ({control}, must FAIL):")
    wrong = certify(session, contexts, params, draws=args.draws, alpha=args.alpha, seed=args.seed + 77,
                    sibling_rule=rule, verifier=verifier, progress=_show,
                    on_draw=DrawProgress(f"{shape}, power control"))
    caught = sum(not r.passed for r in wrong)
    print(f"-- power control rejected in {caught}/{len(wrong)} contexts "
          f"({'the test has power' if caught else 'NO POWER in these contexts'}); {shape} took "
          f"{time.perf_counter() - t0:.0f} s")
    if not passed:
        return "FAIL"
    return "PASS" if caught else "INCONCLUSIVE"


def _show(r) -> None:
    label = (r.context[:61] + "...") if len(r.context) > 64 else r.context
    label = label.replace("\n", " ")
    print(f"{label:64s} {r.draws:6d} {r.first_p_value:8.4f} {r.pair_p_value:9.4f} {r.tau:5.2f}  "
          f"{'PASS' if r.passed else 'FAIL'}", flush=True)
