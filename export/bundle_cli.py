"""`edgespec bundle`: write a runtime bundle from HF checkpoint directories (and export it for more backends)."""
from __future__ import annotations

import argparse
import time

HELP = """Build a bundle from HF model directories (config.json + safetensors; Llama, Qwen2 or Qwen3).

The target's MTP module (DeepSeek-V3 keys at model.layers.N) becomes the bundle's `mtp` drafter, a
--draft directory becomes its `draft_model` drafter, and the n-gram drafter is always there.

examples:
  edgespec bundle --target zoo/target --draft zoo/draft --out build/bundles/zoo --backends numpy_ref,onnx
  edgespec bundle --target ~/models/Qwen3-0.6B --out build/bundles/qwen3
"""


def register(sub) -> None:
    p = sub.add_parser("bundle", help="build a bundle from HF checkpoint directories",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="DIR", help="HF directory of the target model")
    p.add_argument("--draft", metavar="DIR", help="HF directory of a separate draft model (same tokenizer)")
    p.add_argument("--out", required=True, metavar="DIR", help="bundle directory to write (replaced if it exists)")
    p.add_argument("--backends", default="numpy_ref", help="comma-separated: numpy_ref (always), onnx")
    p.add_argument("--default-drafter", help="drafter used when a request names none (default: draft_model if given)")
    p.set_defaults(func=run)


def run(args) -> int:
    from export.bundle_builder import build_bundle

    t0 = time.perf_counter()
    out = build_bundle(args.target, args.out, args.draft, default_drafter=args.default_drafter)
    print(f"bundle: wrote {out} (numpy_ref) in {time.perf_counter() - t0:.1f} s")
    backends = [b.strip() for b in args.backends.split(",") if b.strip() and b.strip() != "numpy_ref"]
    for backend in backends:
        if backend != "onnx":
            raise SystemExit(f"bundle: backend {backend!r} cannot be exported here (onnx only)")
        from export.onnx import add_onnx_to_bundle

        t1 = time.perf_counter()
        files = add_onnx_to_bundle(out, "fp32", None, validate=True)
        print(f"bundle: added {', '.join(files)} in {time.perf_counter() - t1:.1f} s")
    return 0
