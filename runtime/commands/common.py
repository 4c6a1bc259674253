"""Arguments shared by the runtime subcommands (bundle, backend, drafter, sampling).

Every flag lands in the typed RuntimeConfig through `config.override`, so a flag meets exactly the
checks its YAML key does and a bad value is a ConfigError naming the flag, the key, the value and
the range (`--branching: drafter.branching: got 0, expected >= 1`)."""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import List

from runtime.model.bundle import MANIFEST
from runtime.config import RuntimeConfig, load_config, override
from runtime.errors import BundleError, ConfigError
from runtime.serving.session import GenerationParams

DEFAULT_BUNDLE = RuntimeConfig().bundle  # relative: resolved by `resolve_bundle_dir`

# flag attribute -> config key it sets (sampling keys only where the command defines the flag)
MODEL_FLAGS = {"backend": "backend.kind", "precision": "backend.precision", "drafter": "drafter.kind",
               "num_draft": "drafter.num_tokens", "branching": "drafter.branching", "shape": "drafter.shape",
               "max_context": "memory.max_context", "prefix_cache": "memory.prefix_cache",
               "exceed_max_position_embeddings": "memory.exceed_max_position_embeddings",
               "prefill_chunk": "memory.prefill_chunk",
               "lossy_typical_acceptance": "decoding.lossy_typical_acceptance"}
SAMPLING_FLAGS = {"max_tokens": "generation.max_tokens", "temperature": "generation.temperature",
                  "top_p": "generation.top_p", "top_k": "generation.top_k", "seed": "generation.seed"}


def edgespec_root() -> str:
    """Where relative bundle paths of a config are taken from: $EDGESPEC_ROOT, else the source tree
    this package runs from (the directory holding runtime/)."""
    env = os.environ.get("EDGESPEC_ROOT")
    if env:
        return os.path.abspath(env)
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_bundle_dir(path: str, source: str) -> str:
    """A config's (or the default's) bundle path, made absolute from `edgespec_root()` so that it does not
    depend on the working directory; a BundleError saying where it looked when no bundle is there.
    (A --bundle flag is a path like any other: relative to the working directory.)"""
    if os.path.isabs(path):
        return path
    full = os.path.join(edgespec_root(), path)
    if not os.path.isfile(os.path.join(full, MANIFEST)):
        where = ("$EDGESPEC_ROOT" if os.environ.get("EDGESPEC_ROOT") else
                 "the edgespec source tree (set EDGESPEC_ROOT to use another)")
        raise BundleError(f"{full}: no bundle there. The bundle path {path!r} ({source}) is relative, so it was "
                          f"taken from {where}, {edgespec_root()}. Build it with `make bundles` there, or pass "
                          "--bundle DIR")
    return full


def add_model_args(p: argparse.ArgumentParser, drafter: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--config", help="a runtime YAML (configs/runtime.yaml); flags below override it")
    g.add_argument("--bundle", help=f"bundle directory, relative to the working directory (default: {DEFAULT_BUNDLE} "
                                    "under $EDGESPEC_ROOT, else under the edgespec source tree; built by "
                                    "`make bundles`)")
    g.add_argument("--backend", choices=["auto", "numpy_ref", "onnx", "tensorrt", "gguf"],
                   help="backend to run the target on (default auto: onnx where onnxruntime is installed and the "
                        "bundle has ONNX graphs, else numpy_ref, the exact but slow oracle; gguf = llama.cpp on "
                        "the bundle's GGUF, after `edgespec export --to gguf`)")
    g.add_argument("--precision", help="onnx: the bundle's target graph to run, auto | fp32 | fp16 | int8 | int4 "
                                       "(default auto = its float graph; int8/int4 from `edgespec export --to onnx "
                                       "--precision int8`, then the quantised graph IS the target); gguf: the "
                                       "bundle's quant to run, f16 | q8_0 | q4_K_M (default auto = the most precise "
                                       "it holds; added by `edgespec export --to gguf --precision q8_0`)")
    if drafter:
        g.add_argument("--drafter", help="none | ngram | draft_model | mtp | a drafter named in the bundle "
                                         "(default: the bundle's)")
    g.add_argument("--num-draft", type=int, help="draft tokens per branch per cycle, 1..64 (default 4)")
    g.add_argument("--branching", type=int, help="branches per tree node, 1..16 (default 1 = a chain)")
    g.add_argument("--shape", choices=["auto", "fixed", "adaptive"],
                   help="draft shape: fixed = the drafter's own every cycle; adaptive = each cycle's node budget from "
                        "the cost model and the acceptance so far; auto (default) = adaptive where `edgespec tune` "
                        "measured this machine, else fixed")
    g.add_argument("--max-context", type=int, help="KV positions per model, 16..1048576, at most the model's "
                                                   "max_position_embeddings (default 2048, cut to that)")
    g.add_argument("--exceed-max-position-embeddings", dest="exceed_max_position_embeddings", action="store_const",
                   const=True, help="allow --max-context past the model's max_position_embeddings (the context it was "
                                    "trained for; beyond it the output degrades)")
    g.add_argument("--prefill-chunk", type=int, help="tokens per prefill forward (default 512): a longer prompt runs "
                                                     "as several forwards (exact), bounding its scratch")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False,
                   help="prefill every prompt in full (default: keep the K/V of the prefix shared with the "
                        "previous request; exact either way)")
    g.add_argument("--lossy-typical-acceptance", dest="lossy_typical_acceptance", action="store_const", const=True,
                   help="LOSSY: accept sampled drafts by Medusa's typical acceptance (p(x) > min(0.09, "
                        "0.3*exp(-H(p)))) instead of exact rejection sampling; changes the output distribution "
                        "(greedy stays exact); certify refuses it. Default: exact")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; unset ones take the config's `generation` values (the defaults below without --config)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, help="tokens to generate at most, >= 1 (default 128)")
    g.add_argument("--temperature", type=float, help="0 = greedy (default); > 0 samples, up to 100")
    g.add_argument("--top-p", type=float, help="nucleus mass kept, in (0, 1]; 1 = off (default)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens, >= 0; 0 = off (default)")
    g.add_argument("--seed", type=int, help="RNG seed for sampling, >= 0 (default 0)")


def runtime_config(args) -> RuntimeConfig:
    """The config a command runs with: --config (or the defaults), then each flag given, each checked."""
    cfg = load_config(args.config) if getattr(args, "config", None) else RuntimeConfig()
    if getattr(args, "bundle", None):
        cfg = replace(cfg, bundle=os.path.abspath(args.bundle))
    else:
        cfg = replace(cfg, bundle=resolve_bundle_dir(cfg.bundle, args.config or "the default"))
    for attr, key in {**MODEL_FLAGS, **SAMPLING_FLAGS}.items():
        value = getattr(args, attr, None)
        if value is not None:
            cfg = override(cfg, key, value, "--" + attr.replace("_", "-"))
    return cfg


def generation_params(cfg: RuntimeConfig) -> GenerationParams:
    g = cfg.generation
    return GenerationParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                            min_p=g.min_p, repetition_penalty=g.repetition_penalty, seed=g.seed, stop=g.stop)


def split_list(flag: str, text: str, known) -> List[str]:
    """The names of a comma-separated flag, each one of `known`, or a ConfigError naming the flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ConfigError(f"{flag}: got {text!r}, expected a comma-separated list of {sorted(known)}")
    return names
