"""Time to first token with and without the prompt prefix cache, side by side in one process.

    python scripts/prefix_cache_ttft.py [--bundle build/bundles/zoo] [--backend onnx] [--requests 40]

Two sessions per drafter (cache on / off) take the same requests, alternating which goes first: a 10 Hz action
loop (same instruction, a new observation each call) and replanning (same task, a new failure report each call).
Prints TTFT p50 / p99 and how many prompt tokens the cache kept."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.text.prompts import OBS_DIMS  # noqa: E402
from runtime.serving.session import GenerationParams, Session  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="build/bundles/zoo")
    ap.add_argument("--backend", default="onnx")
    ap.add_argument("--drafters", default="none,draft_model")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| drafter | requests | prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | prompt tokens kept |")
    print("| --- | --- | --- | --- | --- | --- |")
    for drafter in args.drafters.split(","):
        sessions = {c: Session.open(args.bundle, drafter=drafter, backend=args.backend, prefix_cache=c) for c in (False, True)}
        got = {(c, k): [] for c in (False, True) for k in ("action loop", "replanning")}
        for i in range(args.requests):
            obs = list(np.round(rng.uniform(-0.5, 0.5, OBS_DIMS), 2))
            for c in ((False, True) if i % 2 else (True, False)):
                s = sessions[c].action_tokens("lift the metal apple", observation=obs, num_actions=8).stats
                got[(c, "action loop")].append((s.ttft_s, s.prefix_tokens, s.prefix_tokens + s.prefill_tokens))
        for i in range(args.requests):
            report = f'failed {{"skill":"pick","object":"red cup"}}: not found after {i} tries'
            for c in ((False, True) if i % 2 else (True, False)):
                s = sessions[c].plan("move the red cup from the kitchen to the sink in the garage", context=report,
                                     params=GenerationParams(max_tokens=8)).stats
                got[(c, "replanning")].append((s.ttft_s, s.prefix_tokens, s.prefix_tokens + s.prefill_tokens))
        for kind in ("action loop", "replanning"):
            for c in (False, True):
                a = np.asarray(got[(c, kind)][3:])  # the first requests warm the backend
                print(f"| {drafter} | {kind} | {'on' if c else 'off'} | {np.percentile(a[:, 0], 50) * 1e3:.1f} | "
                      f"{np.percentile(a[:, 0], 99) * 1e3:.1f} | {a[:, 1].mean():.1f} of {a[:, 2].mean():.1f} |")
        for s in sessions.values():
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
