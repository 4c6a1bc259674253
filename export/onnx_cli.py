"""`edgespec export --to onnx`: add ONNX graphs of a bundle's target (and draft model) to the bundle."""
from __future__ import annotations

import argparse

EXPORT_TARGETS = ("onnx",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `edgespec export` options in one place (other `--to` targets add theirs here)."""
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS,
                   help="backend to export for: onnx (ONNX Runtime on CPU / CUDA / TensorRT EPs; also the "
                        "source graph for TensorRT engines)")
    p.add_argument("--bundle", required=True, metavar="DIR",
                   help="bundle directory whose numpy_ref target weights are exported; the graphs are added "
                        "to it and bundle.yaml is rewritten with their checksums")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8", "int4"), default="fp32",
                   help="fp32 (default; matches the numpy reference within 1e-4) or fp16 (weights, activations and "
                        "KV cache in float16; norms/softmax in float32): the float graph, one per model (exporting "
                        "the other float precision replaces it and removes its files). int8 / int4: the target's "
                        "decoder-layer weights quantised by ONNX Runtime's MatMulNBits quantiser (block-wise, "
                        "symmetric; activations, KV and LM head float32), stored NEXT to the float graph; run it "
                        "with `--precision int8` (or backend.precision: int8): it then IS the target")
    p.add_argument("--block-size", type=int, default=32, choices=(16, 32, 64, 128, 256),
                   help="int8/int4: input channels per quantisation block, each with its own scale (default 32)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None,
                   help="int8/int4: MatMulNBits' accuracy_level, 0 = float32 compute, 4 = int8 activations and "
                        "integer dot products (default: the faster one measured on CPU, see export/onnx_quantize.py)")
    p.add_argument("--taps", nargs="+", metavar="TAP", default=None,
                   help="hidden states to export as extra outputs: final_norm, layer_in.I, layer_out.I. "
                        "Default: every tap the bundle's drafters read, plus final_norm")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the numeric comparison against the numpy reference after export")


def run(args: argparse.Namespace) -> int:
    from export.onnx import add_onnx_to_bundle

    files = add_onnx_to_bundle(args.bundle, args.precision, args.taps, validate=not args.no_validate,
                               block_size=args.block_size, accuracy_level=args.accuracy_level)
    for f in files:
        print(f"wrote {args.bundle}/{f}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="export a bundle's models for another backend (ONNX)",
                       description="Export the bundle's target (and draft model, if any) for a backend, "
                                   "check the result against the numpy reference and register the files "
                                   "in bundle.yaml. Example: edgespec export --to onnx --bundle build/bundles/zoo")
    add_arguments(p)
    p.set_defaults(func=run)
