"""`edgespec certify`: the statistical exactness test, run on the robot's own bundle and backend."""
from __future__ import annotations

import argparse

from runtime.certify import certify
from runtime.commands.common import add_model_args, runtime_config
from runtime.prompts import action_prompt, planner_prompt, text_prompt
from runtime.sampling import SamplingParams
from runtime.session import Session

HELP = """Prove on this machine that speculative decoding leaves the target's distribution unchanged.

For each context the real engine (drafter + verification + backend) is run DRAWS times from the same
state; the first emitted token and the first two emitted tokens are compared with the exact target
distribution (enumerated) by a chi-square goodness-of-fit test. PASS means p-value >= alpha for both.

example:
  edgespec certify --drafter draft_model --temperature 0.8 --draws 20000
"""

DEFAULT_CONTEXTS = [
    # Mid-plan, where the zoo is unsure which object comes next (a peaked context would test little).
    planner_prompt("give the red box from the workshop to Carol in the bedroom")
    + '[{"skill":"navigate","room":"workshop"},{"skill":"pick","object',
    text_prompt("To be, or not to be"),
    action_prompt("lift the metal apple", [0.30, -0.26, 0.11, -0.03, 0.0, 0.30, -0.26, 0.05]),
]


def register(sub) -> None:
    p = sub.add_parser("certify", help="statistical proof that speculative sampling is exact, on this bundle/backend",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature to certify (> 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--draws", type=int, default=20000, help="independent draws per context (default 20000)")
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level (default 0.001)")
    p.add_argument("--context", action="append", help="a context to test (repeatable); default: planner, text, action")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    session = Session(runtime_config(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    params.validate(session.target.spec.vocab_size)
    contexts = args.context or DEFAULT_CONTEXTS
    print(f"certify: bundle={session.config.bundle} backend={session.backend_name} drafter={session.drafter_kind} "
          f"temperature={args.temperature} top_p={args.top_p} draws={args.draws} alpha={args.alpha}")
    print(f"{'context':42s} {'draws':>6s} {'chi2(t1)':>10s} {'p(t1)':>8s} {'chi2(t1,t2)':>12s} {'p(t1,t2)':>9s} {'tau':>5s}  verdict")

    def show(r):
        label = (r.context[:39] + "...") if len(r.context) > 42 else r.context
        print(f"{label:42s} {r.draws:6d} {r.first_statistic:10.1f} {r.first_p_value:8.4f} {r.pair_statistic:12.1f} "
              f"{r.pair_p_value:9.4f} {r.tau:5.2f}  {'PASS' if r.passed else 'FAIL'}", flush=True)

    results = certify(session, contexts, params, draws=args.draws, alpha=args.alpha, seed=args.seed, progress=show)
    ok = all(r.passed for r in results)
    print("certify: PASS — no evidence that speculative decoding changes the target distribution" if ok else
          "certify: FAIL — the emitted distribution differs from the target's; do not deploy this drafter")
    return 0 if ok else 1
