"""Open a model of a bundle on the chosen backend, with its KV cache carved from the shared arena."""
from __future__ import annotations

import importlib.util
from typing import Sequence

from runtime.model.bundle import Bundle, BackendFiles
from runtime.config import BackendConfig
from runtime.errors import BundleError
from runtime.memory.kv import KVCache
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors

BACKENDS = ("numpy_ref", "onnx", "gguf", "tensorrt")


def resolve_backend(kind: str, bundle: Bundle) -> str:
    """The backend `kind` names; "auto" is onnx where onnxruntime is installed and the bundle's target has
    ONNX graphs (the fast path), else numpy_ref (the exact oracle, several times slower per verify).
    gguf (llama.cpp) is chosen by name only: its quantised weights are a different target."""
    if kind != "auto":
        return kind
    if "onnx" in bundle.target.backends and importlib.util.find_spec("onnxruntime") is not None:
        return "onnx"
    return "numpy_ref"


def load_weights(bundle: Bundle, files: Sequence[str]) -> dict:
    weights = {}
    for rel in files:
        if rel.endswith(".safetensors"):
            weights.update(read_safetensors(bundle.path(rel)))
    return weights


def open_model(bundle: Bundle, spec: ModelSpec, files: BackendFiles, backend: BackendConfig, cache: KVCache,
               taps: Sequence[str] = (), label: str = "target"):
    """A TargetBackend for `spec` whose weights/graphs are `files` of `bundle`."""
    if backend.kind == "numpy_ref":
        from runtime.backends.numpy_ref import NumpyTarget
        return NumpyTarget(spec, load_weights(bundle, files.files), cache, source=f"{bundle.root} ({label})")
    if backend.kind == "onnx":
        from runtime.backends.onnx import OnnxTarget
        graphs = [f for f in files.files if f.endswith(".onnx")]
        if not graphs:
            raise BundleError(f"{bundle.root}: {label} has no .onnx graph; run `edgespec export --to onnx --bundle {bundle.root}`")
        return OnnxTarget(spec, bundle.path(graphs[0]), cache, providers=backend.providers, threads=backend.threads,
                          tap_names=tuple(files.params.get("taps", ("final_norm",))))
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
