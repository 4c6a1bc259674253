"""A bundle as the memory plan sees it: what its entries weigh on disk or in memory (safetensors headers, graph and
GGUF file sizes, a saved memory profile), which backend entry a Session opens, its caches and its K/V element
size, gathered into the plan's `PlanInputs` (runtime/drafters/registry.py `plan_inputs` adds the drafter's part,
as its kind declares it)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional, Tuple

from runtime.memory.kv import CacheShape
from runtime.memory.plan import (GGUF_BATCH, HEAD_OF_QUANT, ONNX_SCRATCH_FACTOR, PREFILL_CHUNK, RUNTIME_OVERHEAD,
                                 DrafterMemory, PlanInputs, dims_from_spec)
from runtime.model.bundle import gguf_entries, onnx_entry_key

def bundle_kv_bytes(bundle, backend: str) -> int:
    """The K/V element size of a bundle on a backend: fp16 graphs and llama.cpp (f16 K/V whatever the weights)
    keep an fp16 cache, all else float32."""
    files = bundle.target.backends.get(backend)
    if files is not None and backend.split(".")[0] == "gguf":  # "gguf", "gguf.q8_0", ...
        return 2
    return 2 if files is not None and files.params.get("precision") == "fp16" else 4


def bundle_cache_shapes(bundle, drafter_shapes: Dict[str, CacheShape]) -> Dict[str, CacheShape]:
    """The caches a Session allocates: the target's and those its drafter declares (a draft model's, an MTP
    module's one layer of the target's shape, ...)."""
    spec = bundle.target.spec
    return {"target": CacheShape(spec.num_layers, spec.num_kv_heads, spec.head_dim), **drafter_shapes}


def safetensors_numel(path: str) -> int:
    """Elements of every tensor of a safetensors file, from its header only (no tensor is read)."""
    from runtime.model.tensors import _header

    _, header = _header(path)
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def entry_numel(bundle, entry) -> int:
    """Elements of a bundle entry's safetensors files."""
    return sum(safetensors_numel(bundle.path(f)) for f in entry.files if f.endswith(".safetensors"))


def target_embedding_copy_bytes(spec) -> int:
    """A float32 copy of the target's embedding (and untied LM head): what a numpy drafter keeps beside a graph."""
    return 4 * spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)


def _engine_prefill_tokens(bundle, backend: str, chunk: int) -> int:
    """Tokens per target prefill forward: the engine's chunk (memory.prefill_chunk, backends/base.forward_in_chunks),
    or less where the backend splits further: TensorRT engines into their prefill profile
    (runtime/backends/tensorrt.py), llama.cpp into batches of GGUF_BATCH."""
    if backend == "gguf":
        return min(chunk, GGUF_BATCH)
    files = bundle.target.backends.get(backend) if backend == "tensorrt" else None
    profile = (files.params.get("profiles") or {}).get("prefill") if files is not None else None
    return min(chunk, int(profile["max_tokens"])) if profile else chunk


def backend_entry_key(backend: str, precision: str = "auto", bundle=None) -> str:
    """The target backend entry a Session opens: "onnx.int8" for the ONNX int8 graph, "gguf.q8_0" for the
    q8_0 GGUF of `bundle` (auto: its most precise), else the backend's name. One entry is one backend at one
    precision (a GGUF entry holds one quant), so what is measured of it (`edgespec memory profile --save`) is
    stored in its params."""
    if bundle is not None:
        return bundle.target_entry_key(backend, precision)
    return onnx_entry_key(precision) if backend == "onnx" and precision != "auto" else backend


def bundle_overhead(files, backend: str) -> Tuple[int, str]:
    """(runtime overhead bytes, its note): the one `edgespec memory profile --save` measured and stored in the
    backend entry's params.memory_profile, else the default estimate of RUNTIME_OVERHEAD."""
    saved = (files.params.get("memory_profile") or {}) if files is not None else {}
    if isinstance(saved.get("runtime_overhead_bytes"), int):
        return saved["runtime_overhead_bytes"], (f"measured by `edgespec memory profile --save` at context "
                                                 f"{saved.get('context')}, drafter {saved.get('drafter')}")
    return RUNTIME_OVERHEAD.get(backend, RUNTIME_OVERHEAD["onnx"]), "interpreter, libraries (default estimate)"


def _drafter_key(entry, backend: str, t_files) -> Optional[str]:
    """The draft model's entry a Session opens beside the target (runtime/drafters/draft_model.py entry_key):
    gguf: the target's quant, else the draft's most precise GGUF."""
    if backend == "numpy_ref":
        return None
    if backend == "gguf":
        have = gguf_entries(entry.backends)
        quant = t_files.params.get("quant", "f16") if t_files is not None else None
        return have.get(quant, next(iter(have.values()), None))
    return backend


def bundle_inputs(bundle, drafter: Optional[str], draft: DrafterMemory, backend: str, tree_tokens: int,
                  precision: str = "auto", prefill_chunk: int = PREFILL_CHUNK,
                  exceed_max_positions: bool = False) -> PlanInputs:
    """PlanInputs of a bundle as a Session loads it: numpy_ref holds every weight as float32; an ONNX graph
    (fp32, fp16, or `precision` int8 / int4: entry onnx.int8 / onnx.int4, MatMulNBits with a float32 head) and
    a GGUF (f16, q8_0, q4_K_M) weigh what their files weigh; a draft model without a graph for the backend runs
    in numpy (float32). `draft` is what the drafter entry `drafter` (None: no drafter) holds beyond the target,
    as its kind declares it (runtime/drafters/registry.py `plan_inputs` fills both). The prompt is prefilled in
    chunks of `prefill_chunk`; contexts past the target's max_position_embeddings only with `exceed_max_positions`."""
    spec = bundle.target.spec
    target = dims_from_spec(spec)
    key = backend_entry_key(backend, precision, bundle)  # gguf: the chosen quant's entry, its file's size below
    kv = bundle_kv_bytes(bundle, key)
    prec = "fp16" if kv == 2 else "fp32"
    head_prec = prec
    t_files = bundle.target.backends.get(key)
    file_bytes = None
    if t_files is not None and backend in ("onnx", "gguf"):  # loaded as they are on disk (ORT, llama.cpp)
        sizes = [bundle.files[f].size for f in t_files.files if f in bundle.files]
        file_bytes = sum(sizes) if len(sizes) == len(t_files.files) else None
        if backend == "gguf":
            q = t_files.params.get("quant", "f16")
            prec = "fp16" if q == "f16" else q
            head_prec = HEAD_OF_QUANT.get(prec, prec)
        elif t_files.params.get("precision") in ("int8", "int4"):
            prec, head_prec = t_files.params["precision"], "fp32"  # the quantiser keeps the head float32
    entry = bundle.drafters.get(drafter) if drafter is not None else None
    d_key = _drafter_key(entry, backend, t_files) if entry is not None else None
    if entry is not None and draft.dims is not None and backend == "gguf" and d_key in entry.backends:
        quant = entry.backends[d_key].params.get("quant", "f16")  # the draft's GGUF the Session opens
        draft = replace(draft, precision={"f16": "fp16"}.get(quant, quant))
    overhead, overhead_note = bundle_overhead(t_files, backend)
    onnx = backend != "numpy_ref"
    d_graph = entry is not None and entry.spec is not None and d_key in entry.backends
    return PlanInputs(target=target, drafter=draft.dims, precision=prec, head_precision=head_prec,
                      drafter_precision=draft.precision, kv_bytes=kv, drafter_extra_bytes=draft.extra_bytes,
                      tree_tokens=tree_tokens,
                      prefill_tokens=_engine_prefill_tokens(bundle, backend, prefill_chunk),
                      exceed_max_positions=exceed_max_positions,
                      drafter_prefill_tokens=prefill_chunk if draft.prefill_chunked else None,
                      overhead_bytes=overhead, overhead_note=overhead_note, target_file_bytes=file_bytes,
                      scratch_factor=ONNX_SCRATCH_FACTOR if backend not in ("numpy_ref", "gguf") else 1.0,
                      chunk_outputs=backend == "gguf", ggml=backend == "gguf",
                      drafter_scratch=onnx and d_graph)
