"""`edgespec export --to onnx|tensorrt|gguf`: add ONNX graphs of a bundle's target (and draft model) to the bundle,
TensorRT engines built from those graphs (on the device that will run them), or GGUF files for llama.cpp."""
from __future__ import annotations

import argparse

EXPORT_TARGETS = ("onnx", "tensorrt", "gguf")
GGUF_QUANTS = ("f16", "q8_0", "q4_K_M")  # runtime/model/bundle.py GGUF_QUANTS (imported lazily: a fast --help)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `edgespec export` options in one place."""
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS,
                   help="backend to export for: onnx (ONNX Runtime on CPU / CUDA / TensorRT EPs; also the "
                        "source graph for TensorRT engines), tensorrt (engines built from the bundle's ONNX "
                        "graphs with TensorRT, on the Jetson / GPU that will run them) or gguf (llama.cpp)")
    p.add_argument("--bundle", required=True, metavar="DIR",
                   help="bundle directory whose numpy_ref target weights are exported; the graphs are added "
                        "to it and bundle.yaml is rewritten with their checksums")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8", "int4", "f16", "q8_0", "q4_K_M"), default=None,
                   help="onnx: fp32 (default; matches the numpy reference within 1e-4) or fp16 (weights, activations "
                        "and KV cache in float16; norms/softmax in float32): the float graph, one per model (exporting "
                        "the other float precision replaces it and removes its files). int8 / int4: the target's "
                        "decoder-layer weights quantised by ONNX Runtime's MatMulNBits quantiser (block-wise, "
                        "symmetric; activations, KV and LM head float32), stored NEXT to the float graph; run it "
                        "with `--precision int8` (or backend.precision: int8): it then IS the target. "
                        "tensorrt: engines take the precision of the bundle's ONNX graphs (export those with "
                        "--precision fp16 first for fp16 engines); a value here must match them. "
                        "gguf: f16 (default), q8_0 or q4_K_M (or fp16 / int8 / int4 for them): each quant is added "
                        "beside those already in the bundle; backend.precision / --precision picks one at run time")
    p.add_argument("--block-size", type=int, default=32, choices=(16, 32, 64, 128, 256),
                   help="onnx int8/int4: input channels per quantisation block, each with its own scale (default 32)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=None,
                   help="onnx int8/int4: MatMulNBits' accuracy_level, 0 = float32 compute, 4 = int8 activations and "
                        "integer dot products (default: the faster one measured on CPU, see export/onnx/quantize.py)")
    p.add_argument("--attention", choices=("auto", "fused", "matmul", "gqa"), default="auto",
                   help="onnx: auto (default: fused for an fp32 target, matmul for fp16 (the GPU graph), int8/int4 "
                        "and draft models), fused (the graph written with ONNX Runtime's fused contrib ops: "
                        "SkipSimplifiedLayerNormalization, packed QKV, GroupQueryAttention with rope and the tree mask "
                        "as attention_bias; 1.4-2.2x faster a step on CPU), matmul (grouped-query attention from MatMuls, "
                        "runs on every provider, the graph TensorRT engines are built from) or gqa (the traced graph "
                        "with GroupQueryAttention only; checked with onnxruntime 1.32)")
    p.add_argument("--kstep", choices=("auto", "on", "off"), default="auto",
                   help="onnx: the draft model's K-step graph (a whole drafted chain in one run, sampled in the graph; "
                        "export/onnx/kstep.py): auto (default: with --precision fp16, the GPU graph, where the runtime "
                        "takes it; on a CPU the step-wise chain measured faster), on, off")
    p.add_argument("--taps", nargs="+", metavar="TAP", default=None,
                   help="onnx: hidden states to export as extra outputs: final_norm, layer_in.I, layer_out.I. "
                        "Default: every tap the bundle's drafters read, plus final_norm")
    p.add_argument("--quant", default=None, metavar="Q",
                   help="gguf only: the same as --precision: f16 (default), q8_0 or q4_K_M (quantised by llama.cpp's "
                        "own quantiser), added beside the quants the bundle already holds")
    p.add_argument("--force", action="store_true",
                   help="gguf only: replace an existing output file (refused otherwise)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the libraries' own logs and warnings (torch.onnx, onnxscript, llama.cpp's loader "
                        "and quantiser), hidden by default")
    p.add_argument("--no-validate", action="store_true",
                   help="onnx: skip the numeric comparison against the numpy reference after export")
    trt = p.add_argument_group("tensorrt", "engine shapes (tensorrt only)")
    trt.add_argument("--max-context", type=int, default=None, metavar="N",
                     help="positions the engines' KV inputs hold (plus 64 drafted rows); default 2048, or what "
                          "--budget fits. The runtime refuses a memory.max_context above it")
    trt.add_argument("--budget", default=None, metavar="SIZE",
                     help="size the context from the memory plan instead: 5.5GB, 5GiB, 5632MiB or 80%% of "
                          "MemAvailable (see `edgespec memory plan --bundle DIR`)")
    trt.add_argument("--verify-tokens", type=int, default=64, metavar="T",
                     help="the verify profile's largest forward: draft tree nodes + 1 (default 64)")
    trt.add_argument("--prefill-tokens", type=int, default=None, metavar="T",
                     help="the prefill profile's largest forward (default 512); a longer prompt is prefilled in causal "
                          "chunks of this size, which bounds the engine's activation memory")
    trt.add_argument("--workspace-mb", type=int, default=1024, metavar="MIB",
                     help="TensorRT builder workspace limit in MiB (default 1024)")
    trt.add_argument("--lossy-weights", choices=("int8", "int4"), default=None,
                     help="LOSSY: weight-only quantized engines (int8 per output column, int4 in blocks of 128 rows) "
                          "of the decoder projections; embedding, LM head, activations and KV keep the graphs' "
                          "precision. A quantized target is another target: speculative decoding stays exact "
                          "against it, not against the unquantized model")


def _check(args: argparse.Namespace) -> None:
    from runtime.errors import ConfigError

    for flag, value, low in (("--max-context", args.max_context, 16), ("--verify-tokens", args.verify_tokens, 1),
                             ("--prefill-tokens", args.prefill_tokens, 1), ("--workspace-mb", args.workspace_mb, 16)):
        if value is not None and value < low:
            raise ConfigError(f"{flag}: got {value}, expected >= {low}")


def run(args: argparse.Namespace) -> int:
    from export.library_logs import set_verbose
    from runtime.errors import ConfigError

    set_verbose(args.verbose)
    if args.to == "tensorrt":
        return run_tensorrt(args)
    if args.to == "gguf":
        from export.gguf.writer import add_gguf_to_bundle

        if args.taps is not None:
            raise ConfigError("--taps: ONNX only; llama.cpp gives the final-normed hidden state without an export option")
        files = add_gguf_to_bundle(args.bundle, gguf_quant(args.precision, args.quant), force=args.force,
                                   validate=not args.no_validate)
    else:
        if args.quant is not None or args.force:
            raise ConfigError("--quant / --force: GGUF only (--to gguf); an ONNX export takes --precision")
        if args.precision in GGUF_QUANTS:
            raise ConfigError(f"--precision {args.precision}: a GGUF quant (--to gguf); an ONNX export takes fp32, "
                              "fp16, int8 or int4")
        try:
            from export.onnx.bundle import add_onnx_to_bundle
        except ModuleNotFoundError as exc:  # the robot image has no torch / no export.onnx.graph
            from runtime.errors import BackendError

            raise BackendError(f"the ONNX export needs the workstation side ({exc.name} is missing): run it on a "
                               "workstation with `pip install edgespec[export]` and copy the bundle to the robot") from None
        files = add_onnx_to_bundle(args.bundle, args.precision or "fp32", args.taps, validate=not args.no_validate,
                                   block_size=args.block_size, accuracy_level=args.accuracy_level,
                                   attention=args.attention, kstep=args.kstep)
    for f in files:
        print(f"wrote {args.bundle}/{f}")
    return 0


def gguf_quant(precision, quant) -> str:
    """The quant `--to gguf` writes: --precision (a quant, or fp16 / int8 / int4 for f16 / q8_0 / q4_K_M) or
    its older spelling --quant; default f16."""
    from runtime.errors import ConfigError
    from runtime.model.bundle import GGUF_QUANT_OF

    if precision is not None and precision not in GGUF_QUANT_OF:
        raise ConfigError(f"--precision {precision}: no GGUF quant is {precision}; --to gguf takes one of "
                          f"{list(GGUF_QUANTS)} (or fp16 / int8 / int4 for them)")
    picked = GGUF_QUANT_OF[precision] if precision is not None else None
    if picked is not None and quant is not None and quant != picked:
        raise ConfigError(f"--precision {precision} and --quant {quant} disagree; give one of them")
    return picked or quant or "f16"


def run_tensorrt(args: argparse.Namespace) -> int:
    from runtime.model import bundle as bundle_mod
    from runtime.errors import BundleError
    from runtime.memory.devices import parse_budget

    _check(args)
    budget = parse_budget(args.budget) if args.budget is not None else None
    if args.precision is not None:
        onnx = bundle_mod.load(args.bundle).target.backends.get("onnx")
        have = onnx.params.get("precision", "fp32") if onnx is not None else None
        if have != args.precision:
            redo = (f"`edgespec export --to onnx --bundle {args.bundle} --precision fp16`" if args.precision == "fp16"
                    else f"`edgespec export --to onnx --bundle {args.bundle} --precision fp32`")
            raise BundleError(f"--precision {args.precision}: the bundle's ONNX graphs are {have}; engines take the "
                              f"graphs' precision, so run {redo} first")
    from export.tensorrt.build import add_tensorrt_to_bundle

    add_tensorrt_to_bundle(args.bundle, args.max_context, budget, args.verify_tokens, args.prefill_tokens,
                           args.workspace_mb, args.lossy_weights)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="export a bundle's models for another backend (ONNX, TensorRT, GGUF)",
                       description="Export the bundle's target (and draft model, if any) for a backend and register "
                                   "the files in bundle.yaml. onnx: graphs checked against the numpy reference. "
                                   "tensorrt: engines built from those graphs on this machine's GPU (run it on the "
                                   "Jetson). gguf: llama.cpp files, f16 or quantised by llama.cpp's own quantiser. "
                                   "Examples: edgespec export --to onnx --bundle build/bundles/zoo; "
                                   "edgespec export --to tensorrt --bundle build/bundles/zoo --max-context 4096; "
                                   "edgespec export --to gguf --bundle build/bundles/zoo --precision q8_0 (beside the f16 one)")
    add_arguments(p)
    p.set_defaults(func=run)
