"""Arguments shared by the runtime subcommands (bundle, backend, drafter, sampling)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from runtime.config import RuntimeConfig, load_config

DEFAULT_BUNDLE = "build/bundles/zoo"


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--config", help="a runtime YAML (configs/runtime.yaml); flags below override it")
    g.add_argument("--bundle", help=f"bundle directory (default: {DEFAULT_BUNDLE}, built by `make bundles`)")
    g.add_argument("--backend", choices=["numpy_ref", "onnx"], help="backend to run the target on (default numpy_ref)")
    g.add_argument("--drafter", help="none | ngram | draft_model | a drafter named in the bundle (default: the bundle's)")
    g.add_argument("--num-draft", type=int, help="draft tokens per branch per cycle (default 4)")
    g.add_argument("--branching", type=int, help="branches per tree (1 = a chain)")
    g.add_argument("--max-context", type=int, help="KV positions per model (default 2048)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)


def runtime_config(args) -> RuntimeConfig:
    cfg = load_config(args.config) if getattr(args, "config", None) else RuntimeConfig(bundle=DEFAULT_BUNDLE)
    if args.bundle:
        cfg = replace(cfg, bundle=args.bundle)
    if args.backend:
        cfg = replace(cfg, backend=replace(cfg.backend, kind=args.backend))
    d = cfg.drafter
    if args.drafter:
        d = replace(d, kind=args.drafter)
    if args.num_draft is not None:
        d = replace(d, num_tokens=args.num_draft)
    if args.branching is not None:
        d = replace(d, branching=args.branching)
    cfg = replace(cfg, drafter=d)
    if args.max_context is not None:
        cfg = replace(cfg, memory=replace(cfg.memory, max_context=args.max_context))
    return cfg
