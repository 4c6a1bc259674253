"""Export a bundle's target (and draft model) as GGUF for llama.cpp: `edgespec export --to gguf`.

The file is written with the `gguf` package (its GGUFWriter and its own HF -> GGUF tensor-name map), the
same library llama.cpp's `convert_hf_to_gguf.py` writes with; quantisation (q8_0, q4_K_M) is llama.cpp's
own quantiser (`llama_model_quantize`, through llama-cpp-python) run on the f16 file. The converter
itself is not used because it refuses a BPE tokenizer whose pre-tokenizer it does not know by hash
(the zoo's is its own); the tokenizer is written as llama.cpp's "gpt2" (byte-level BPE) vocabulary.

Layout decisions, each the one llama.cpp's converter makes:
  - Llama: HF stores q/k rows for rotate-half rope; llama.cpp's "llama" arch rotates adjacent pairs.
    Permuting each head's rows (first half / second half interleaved) makes the two equal (`permute_qk`).
    Qwen2 / Qwen3 use llama.cpp's NEOX rope (rotate-half): no permutation.
  - llama3 rope scaling travels as the `rope_freqs` tensor: per-frequency divisors of the base frequency,
    taken here from the numpy reference's own scaled frequencies (runtime.model.layers.rope_inv_freq).
  - 2-D weights in f16, norms and biases in f32 (llama.cpp's "mostly f16"); a tied head is not written
    (llama.cpp reads token_embd as the output when `output.weight` is absent).

Bundle entries: target.backends.gguf = {files: [gguf/target.f16.gguf], params: {quant, precision, kv_type}},
target.backends."gguf.q8_0" / "gguf.q4_K_M" the quantised files beside it (each export adds its quant and keeps
the others; `backend.precision` picks one); a draft model gets drafters.<name>.backends.<same key> likewise."""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from export.drafters import registry
from runtime.model import bundle as bundle_mod
from runtime.backends import llamacpp as llamacpp_backend
from runtime.backends.numpy_ref import load_float32, required_weight_names
from runtime.errors import BackendError, BundleError
from runtime.model.layers import rope_inv_freq
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors

QUANTS = ("f16", "q8_0", "q4_K_M")
# llama.cpp's llama_ftype values (include/llama.h), the quantiser's target types.
LLAMA_FTYPE = {"f16": 1, "q8_0": 7, "q4_K_M": 15}
PRECISION_OF_QUANT = {"f16": "fp16", "q8_0": "int8", "q4_K_M": "int4"}  # runtime/memory/plan.py's weight classes


def _gguf():
    try:
        import gguf
    except ImportError:
        raise BundleError("exporting GGUF needs the `gguf` package: `pip install edgespec[gguf]`") from None
    return gguf


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise BundleError(f"--quant: got {quant!r}, expected one of {list(QUANTS)}")
    return quant


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection (heads * d, in) from rotate-half order to llama.cpp's adjacent pairs.

    Within each head, row i of the first half and row i of the second half become rows 2i and 2i+1:
    head rows [a0 a1 b0 b1] (d = 4, a = first half, b = second half) -> [a0 b0 a1 b1]."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _arch(gguf, spec: ModelSpec):
    return {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[spec.family]


def _add_tokenizer(writer, gguf, tokenizer_json: str, spec: ModelSpec) -> None:
    """The HF byte-level BPE tokenizer as llama.cpp's "gpt2" vocabulary: tokens by id, merges, types."""
    with open(tokenizer_json) as f:
        tok = json.load(f)
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise BundleError(f"{tokenizer_json}: a {model.get('type')!r} tokenizer; the GGUF export writes byte-level BPE "
                          "tokenizers only (Llama-3, Qwen2/3 and the zoo's)")
    by_id: Dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    special = set()
    for added in tok.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        if added.get("special"):
            special.add(int(added["id"]))
    n = max(spec.vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:  # a vocabulary padded past the tokenizer (embedding rows no text maps to)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    # llama.cpp knows pre-tokenizers by name; ours is not among them, so llama.cpp's own tools split text
    # with its default rules. edgespec passes token ids (tokenised by the bundle's tokenizer.json) and
    # never uses llama.cpp's text tokenizer.
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if spec.bos_token_id is not None:
        writer.add_bos_token_id(int(spec.bos_token_id))
    if spec.eos_token_ids:
        writer.add_eos_token_id(int(spec.eos_token_ids[0]))
    writer.add_add_bos_token(False)


def write_gguf_f16(spec: ModelSpec, weights: Mapping[str, np.ndarray], tokenizer_json: str, out_path: str,
                   name: str = "edgespec") -> str:
    """One decoder (target or draft model) as an f16 GGUF at `out_path` (written as it is: callers pass a
    temporary path and rename)."""
    gguf = _gguf()
    arch = _arch(gguf, spec)
    w = load_float32(weights, required_weight_names(spec), out_path)
    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if spec.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling.factor)
    _add_tokenizer(writer, gguf, tokenizer_json, spec)
    names = gguf.get_tensor_name_map(arch, spec.num_layers)
    if spec.rope_scaling.kind == "llama3":
        d = spec.head_dim
        base = 1.0 / (spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        divisors = (base / rope_inv_freq(spec).astype(np.float64)).astype(np.float32)  # llama.cpp divides by these
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", divisors)
    for hf_name, arr in w.items():
        if spec.family == "llama" and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            arr = permute_qk(arr, spec.num_heads)
        elif spec.family == "llama" and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            arr = permute_qk(arr, spec.num_kv_heads)
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise BundleError(f"{out_path}: no GGUF name for tensor {hf_name!r} of a {spec.family} model")
        writer.add_tensor(new, np.ascontiguousarray(arr, np.float16 if arr.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def quantize(src: str, dst: str, quant: str, threads: int = 0) -> None:
    """llama.cpp's own quantiser: `src` (f16 GGUF) -> `dst` at `quant`."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BackendError(f"--quant {quant} runs llama.cpp's quantiser: install llama-cpp-python "
                           "(scripts/bootstrap.sh builds it; `pip install edgespec[gguf]` elsewhere), or export f16")
    llama_cpp = llamacpp_backend.library()  # its loader / quantiser log kept (--verbose prints it), not printed
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE[quant]
    params.nthread = threads or os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise BackendError(f"{dst}: llama.cpp's quantiser failed to write {quant} (code {rc})"
                           f"{llamacpp_backend.recent_log()}")


def write_gguf(spec: ModelSpec, weights: Mapping[str, np.ndarray], tokenizer_json: str, out_path: str,
               quant: str = "f16", name: str = "edgespec") -> str:
    """Write the model at `quant` to `out_path` atomically: built under a temporary name beside it, then renamed."""
    check_quant(quant)
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    tmp = []
    try:
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix=f".{os.path.basename(out_path)}.", suffix=".tmp", dir=folder)
            os.close(fd)
            tmp.append(path)
        write_gguf_f16(spec, weights, tokenizer_json, tmp[0], name)
        final = tmp[0]
        if quant != "f16":
            quantize(tmp[0], tmp[1], quant)
            final = tmp[1]
        bundle_mod.give_normal_mode(final)  # mkstemp made it 0o600
        os.replace(final, out_path)
    finally:
        for path in tmp:
            if os.path.exists(path):
                os.unlink(path)
    return out_path


def validate_gguf(spec: ModelSpec, weights: Mapping[str, np.ndarray], gguf_path: str, quant: str,
                  verbose: bool = True) -> Optional[float]:
    """Logits of the GGUF on llama.cpp against the numpy reference (prefill, decode, a 4-node tree): the max
    relative error, or None when llama-cpp-python is not installed (said, not hidden)."""
    from export.onnx.graph import reference_cases  # the same cases the ONNX export is checked on
    from runtime.backends.numpy_ref import NumpyTarget, cache_shape
    from runtime.memory.kv import KVArena

    try:
        from runtime.backends.llamacpp import LlamaCppTarget
    except ImportError:
        return None
    if not LlamaCppTarget.available():
        if verbose:
            print(f"{gguf_path}: not checked against the numpy reference (llama-cpp-python is not installed)")
        return None
    worst = 0.0
    for name, prefix, tokens, positions, mask in reference_cases(spec):
        n = len(prefix) + len(tokens)
        shape = cache_shape(spec)
        ref = NumpyTarget(spec, weights, KVArena.for_context({"t": shape}, n).allocate("t", shape, n))
        lc = LlamaCppTarget(spec, gguf_path, KVArena.for_context({"t": shape}, n, np.float16).allocate("t", shape, n))
        if len(prefix):
            ref.forward(prefix, np.arange(len(prefix)))
            lc.forward(prefix, np.arange(len(prefix)))
        a, b = lc.forward(tokens, positions, mask).logits, ref.forward(tokens, positions, mask).logits
        err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))
        worst = max(worst, err)
        if verbose:
            print(f"  {name:8s} T={len(tokens):2d} P={len(prefix):2d}  logits max rel err {err:.2e}")
        lc.close()
    if verbose:
        print(f"{gguf_path}: max rel error vs numpy reference {worst:.2e} ({quant})")
    return worst


def _safetensors_weights(b, files: Sequence[str]) -> Dict[str, np.ndarray]:
    weights: Dict[str, np.ndarray] = {}
    for rel in files:
        if rel.endswith(".safetensors"):
            weights.update(read_safetensors(b.path(rel)))
    return weights


def add_gguf_to_bundle(bundle_dir: str, quant: str = "f16", force: bool = False, validate: bool = True,
                       only: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """Write the bundle's target (from its numpy_ref safetensors) and every draft model as GGUF at `quant`
    and register them as backend entry "gguf" (f16) / "gguf.<quant>", beside the other quants already there
    (`backend.precision` picks one at run time). An existing output file is refused unless `force`. `only`:
    export just these draft models (a drafter added to the bundle), not the target. Returns the new files."""
    check_quant(quant)
    b = bundle_mod.load(bundle_dir)
    weights = _safetensors_weights(b, b.target_files("numpy_ref").files)
    if not weights:
        raise BundleError(f"{bundle_dir}: the numpy_ref target lists no .safetensors files to export from")
    models = [] if only is not None else [("target", b.target.spec, weights, f"gguf/target.{quant}.gguf")]
    for name, d in b.drafters.items():
        if registry.is_decoder(d.kind) and d.spec is not None and (only is None or name in only):
            dw = _safetensors_weights(b, d.files)
            if dw:
                models.append((name, d.spec, dw, f"gguf/drafter.{name}.{quant}.gguf"))
    for _, _, _, rel in models:
        if os.path.exists(os.path.join(bundle_dir, rel)) and not force:
            raise BundleError(f"{os.path.join(bundle_dir, rel)}: already exists; pass --force to replace it")
    writer = bundle_mod.BundleWriter.extend(bundle_dir)
    before = _listed_gguf_files(writer.manifest)
    params = {"quant": quant, "precision": PRECISION_OF_QUANT[quant], "kv_type": "f16"}
    key = bundle_mod.gguf_entry_key(quant)
    written = []
    for name, spec, w, rel in models:
        full = os.path.join(bundle_dir, rel)
        write_gguf(spec, w, b.path(b.tokenizer), full, quant, name=f"{b.name}-{name}")
        if validate:
            validate_gguf(spec, w, full, quant)
        owner = writer.manifest["target"] if name == "target" else writer.manifest["drafters"][name]
        backends = owner.setdefault("backends", {})
        _drop_entries_of_quant(backends, quant)  # the entry this export replaces, whatever its key
        _rekey_gguf_entries(backends)  # an older bundle's one "gguf" entry of another quant moves to its own key
        if name == "target":
            writer.add_target_backend(key, [rel], params)
        else:
            writer.add_drafter_backend(name, key, [rel], params)
        written.append(rel)
    listed = set(writer.manifest.get("files") or {})
    for stale in sorted((before - _listed_gguf_files(writer.manifest)) & listed):
        os.remove(os.path.join(bundle_dir, stale))
        print(f"{bundle_dir}/{stale}: removed (replaced by the {quant} export)")
    writer.write()
    return tuple(written)


def _drop_entries_of_quant(backends: dict, quant: str) -> None:
    """Remove the GGUF entries of `quant` from one manifest `backends` mapping (re-exported under its key)."""
    for k in [k for k, e in backends.items() if (k == "gguf" or k.startswith("gguf."))
              and str((e.get("params") or {}).get("quant", "f16")) == quant]:
        del backends[k]


def _rekey_gguf_entries(backends: dict) -> None:
    """Put each GGUF entry of one manifest `backends` mapping under its quant's key ("gguf" = f16, "gguf.q8_0"):
    a bundle from before quants sat side by side keeps any quant under "gguf", which the f16 export takes."""
    for k in [k for k in backends if k == "gguf" or k.startswith("gguf.")]:
        proper = bundle_mod.gguf_entry_key(str((backends[k].get("params") or {}).get("quant", "f16")))
        if proper != k and proper not in backends:
            backends[proper] = backends.pop(k)


def _listed_gguf_files(manifest: Mapping) -> set:
    """Every file a GGUF entry (any quant) of the target or a drafter names."""
    entries = list((manifest["target"].get("backends") or {}).items())
    entries += [kv for d in (manifest.get("drafters") or {}).values() for kv in (d.get("backends") or {}).items()]
    return {f for k, e in entries if k == "gguf" or k.startswith("gguf.") for f in e.get("files", ())}
