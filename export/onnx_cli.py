"""`edgespec export --to onnx|gguf`: add ONNX graphs or GGUF files of a bundle's target (and draft model) to the bundle."""
from __future__ import annotations

import argparse

EXPORT_TARGETS = ("onnx", "gguf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `edgespec export` options in one place (other `--to` targets add theirs here)."""
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS,
                   help="backend to export for: onnx (ONNX Runtime on CPU / CUDA / TensorRT EPs; also the "
                        "source graph for TensorRT engines) or gguf (llama.cpp)")
    p.add_argument("--bundle", required=True, metavar="DIR",
                   help="bundle directory whose numpy_ref target weights are exported; the graphs are added "
                        "to it and bundle.yaml is rewritten with their checksums")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp32 (default; matches the numpy reference within 1e-4) or fp16 (weights, "
                        "activations and KV cache in float16; norms/softmax in float32). A bundle holds one ONNX "
                        "entry per model: exporting the other precision replaces it and removes its files")
    p.add_argument("--taps", nargs="+", metavar="TAP", default=None,
                   help="hidden states to export as extra outputs: final_norm, layer_in.I, layer_out.I. "
                        "Default: every tap the bundle's drafters read, plus final_norm")
    p.add_argument("--quant", default=None, metavar="Q",
                   help="gguf only: f16 (default), q8_0 or q4_K_M (quantised by llama.cpp's own quantiser). A bundle "
                        "holds one GGUF entry per model: exporting another quant replaces it and removes its files")
    p.add_argument("--force", action="store_true",
                   help="gguf only: replace an existing output file (refused otherwise)")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the numeric comparison against the numpy reference after export")


def run(args: argparse.Namespace) -> int:
    from runtime.errors import ConfigError

    if args.to == "gguf":
        from export.gguf import add_gguf_to_bundle

        if args.taps is not None:
            raise ConfigError("--taps: ONNX only; llama.cpp gives the final-normed hidden state without an export option")
        files = add_gguf_to_bundle(args.bundle, args.quant or "f16", force=args.force, validate=not args.no_validate)
    else:
        from export.onnx import add_onnx_to_bundle

        if args.quant is not None or args.force:
            raise ConfigError("--quant / --force: GGUF only (--to gguf); an ONNX export takes --precision")
        files = add_onnx_to_bundle(args.bundle, args.precision, args.taps, validate=not args.no_validate)
    for f in files:
        print(f"wrote {args.bundle}/{f}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="export a bundle's models for another backend (ONNX, GGUF)",
                       description="Export the bundle's target (and draft model, if any) for a backend, "
                                   "check the result against the numpy reference and register the files "
                                   "in bundle.yaml. Examples: edgespec export --to onnx --bundle build/bundles/zoo; "
                                   "edgespec export --to gguf --bundle build/bundles/zoo --quant q8_0")
    add_arguments(p)
    p.set_defaults(func=run)
