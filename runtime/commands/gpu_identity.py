"""`python -m runtime.commands.gpu_identity`: speculative greedy output equals plain greedy output on the
given ONNX Runtime providers (the KV arena on their device), for each drafter over a few zoo-style prompts.
What scripts/gpu_check.sh runs on a machine with a GPU (runtime/backends/onnx_arena.py holds the arena itself)."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def greedy_identity(bundle_dir: str, providers: Sequence[str], drafters: Sequence[str] = ("draft_model", "ngram"),
                    prompts: int = 8, max_tokens: int = 48) -> dict:
    """Speculative greedy output equals plain greedy output on `providers` (the KV arena on their device),
    for each drafter over `prompts` zoo-style prompts. Returns a JSON-able report; report["identical"] is
    the verdict. What scripts/gpu_check.sh runs on a machine with a GPU."""
    from dataclasses import replace

    from runtime.config import RuntimeConfig
    from runtime.serving.session import GenerationParams, Session

    def session(drafter: str) -> Session:
        cfg = RuntimeConfig(bundle=bundle_dir)
        return Session(replace(cfg, backend=replace(cfg.backend, kind="onnx", providers=tuple(providers)),
                               drafter=replace(cfg.drafter, kind=drafter)))

    texts = _prompts(prompts)
    plain = session("none")
    device = getattr(plain.target, "device", "cpu")
    reference = [plain.generate(t, GenerationParams(max_tokens=max_tokens)).token_ids for t in texts]
    report = {"bundle": bundle_dir, "providers": list(providers), "arena_device": device,
              "session_providers": plain.target.session.get_providers(), "prompts": len(texts), "drafters": {}}
    for name in drafters:
        s = session(name)
        got = [s.generate(t, GenerationParams(max_tokens=max_tokens)) for t in texts]
        report["drafters"][name] = {"identical": all(g.token_ids == r for g, r in zip(got, reference)),
                                    "mismatches": [i for i, (g, r) in enumerate(zip(got, reference)) if g.token_ids != r],
                                    "tau": float(np.mean([g.stats.tau for g in got]))}
    report["identical"] = all(d["identical"] for d in report["drafters"].values())
    return report


def _prompts(n: int) -> List[str]:
    from runtime.text.prompts import action_prompt, planner_prompt

    base = [planner_prompt("give the red box from the workshop to Carol in the bedroom"),
            planner_prompt("put two apples in the fridge"),
            action_prompt("lift the metal apple", [0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 1.0, 0.5]),
            "<|bos|><|text|>To be, or not", "<|bos|><|text|>Now is the winter of our discontent"]
    return [base[i % len(base)] for i in range(n)]


def main(argv=None) -> int:
    import argparse
    import json
    import sys

    from runtime.errors import EdgespecError

    ap = argparse.ArgumentParser(prog="python -m runtime.commands.gpu_identity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--providers", nargs="+", default=["CUDAExecutionProvider", "CPUExecutionProvider"])
    ap.add_argument("--drafters", nargs="+", default=["draft_model", "ngram"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    try:
        report = greedy_identity(a.bundle, a.providers, a.drafters, a.prompts, a.max_tokens)
    except EdgespecError as exc:
        print(f"gpu_identity: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
