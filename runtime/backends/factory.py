"""Open a model of a bundle on the chosen backend, with its KV cache carved from the shared arena."""
from __future__ import annotations

import importlib.util
import sys
from typing import Callable, Optional, Sequence

from runtime.model.bundle import ONNX_PRECISIONS, Bundle, BackendFiles, onnx_entry_key
from runtime.config import BackendConfig
from runtime.errors import BundleError
from runtime.memory.kv import KVCache
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors

BACKENDS = ("numpy_ref", "onnx", "gguf", "tensorrt")


def resolve_backend(kind: str, bundle: Bundle, precision: str = "auto",
                    note: Optional[Callable[[str], None]] = None) -> str:
    """The backend `kind` names; "auto" is onnx where onnxruntime is installed and the bundle's target has
    the ONNX graph `precision` picks (the fast path), else numpy_ref (the exact oracle, several times slower
    per verify), and then `note` (default: one line on stderr, once per bundle and reason) says why.
    gguf (llama.cpp) is chosen by name only: its quantised weights are a different target."""
    if kind != "auto":
        return kind
    reason = auto_fallback_reason(bundle, precision, importlib.util.find_spec("onnxruntime") is not None)
    if reason is None:
        return "onnx"
    line = f"backend auto: running numpy_ref (exact, several times slower than onnx) because {reason}"
    (note or say_once)(line)
    return "numpy_ref"


_SAID: set = set()  # lines already printed: a bench opening ten sessions says each once


def say_once(line: str) -> None:
    """One line for the operator on stderr, once per process (a fallback, a tune that is not used)."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def auto_fallback_reason(bundle: Bundle, precision: str, have_onnxruntime: bool) -> Optional[str]:
    """Why `backend: auto` cannot run the bundle on ONNX Runtime, in words; None when it can."""
    key = onnx_entry_key(precision) if precision in ONNX_PRECISIONS else "onnx"
    others = sorted(k for k in bundle.target.backends if k not in ("numpy_ref", key))
    export = f"`edgespec export --to onnx --bundle {bundle.root}" + (f" --precision {precision}`" if key != "onnx" else "`")
    if key not in bundle.target.backends:
        kinds = sorted({k.split(".")[0] for k in others})
        held = f"; its {', '.join(others)} entries run only when named (--backend {kinds[0]})" if kinds else ""
        graph = "ONNX target graph" if key == "onnx" else f"{precision} ONNX target graph"
        return f"{bundle.root} has no {graph} (add it with {export}){held}"
    if not have_onnxruntime:
        return "onnxruntime is not installed, so the bundle's ONNX graphs cannot run here (`pip install edgespec[onnx]`)"
    return None


def load_weights(bundle: Bundle, files: Sequence[str]) -> dict:
    weights = {}
    for rel in files:
        if rel.endswith(".safetensors"):
            weights.update(read_safetensors(bundle.path(rel)))
    return weights


def open_model(bundle: Bundle, spec: ModelSpec, files: BackendFiles, backend: BackendConfig, cache: KVCache,
               taps: Sequence[str] = (), label: str = "target", profile_prefix: str = "", spinning: Optional[str] = None):
    """A TargetBackend for `spec` whose weights/graphs are `files` of `bundle`. onnx only: `profile_prefix` turns on
    ORT's per-node profiler, `spinning` its intra-op threads' spinning (onnx_net.SPINNING; None: backend.spinning; bench_backend measures each)."""
    if backend.kind == "numpy_ref":
        from runtime.backends.numpy_ref import NumpyTarget
        return NumpyTarget(spec, load_weights(bundle, files.files), cache, source=f"{bundle.root} ({label})")
    if backend.kind == "onnx":
        from runtime.backends.onnx import OnnxTarget
        graphs = [f for f in files.files if f.endswith(".onnx")]
        if not graphs:
            raise BundleError(f"{bundle.root}: {label} has no .onnx graph; run `edgespec export --to onnx --bundle {bundle.root}`")
        return OnnxTarget(spec, bundle.path(graphs[0]), cache, providers=backend.providers, threads=backend.threads,
                          tap_names=tuple(files.params.get("taps", ("final_norm",))), profile_prefix=profile_prefix,
                          spinning=backend.spinning if spinning is None else spinning)
    if backend.kind == "tensorrt":
        from runtime.backends.tensorrt import TensorRTTarget
        engines = [f for f in files.files if f.endswith(".engine")]
        if not engines:
            raise BundleError(f"{bundle.root}: {label} has no TensorRT engine; build it on the device with "
                              f"`edgespec export --to tensorrt --bundle {bundle.root}`")
        return TensorRTTarget(spec, bundle.path(engines[0]), cache, files.params,
                              tap_names=tuple(files.params.get("taps", ("final_norm",))), bundle_root=bundle.root,
                              cuda_graphs=backend.cuda_graphs)
    if backend.kind == "gguf":
        from runtime.backends.llamacpp import LlamaCppTarget
        models = [f for f in files.files if f.endswith(".gguf")]
        if not models:
            raise BundleError(f"{bundle.root}: {label} has no .gguf file; run `edgespec export --to gguf --bundle {bundle.root}`")
        return LlamaCppTarget(spec, bundle.path(models[0]), cache, threads=backend.threads, tap_names=taps)
    raise BundleError(f"backend {backend.kind!r} cannot run on this machine (available here: numpy_ref, onnx, gguf "
                      "where llama-cpp-python is installed, tensorrt where TensorRT and CUDA are installed)")
