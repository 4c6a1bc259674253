"""Export a decoder (the target, or a draft model) as an ONNX graph for batch-1 decoding with a KV cache.

The graph is hand-written in torch rather than traced through HF's forward, because HF returns the
whole present K/V (a copy of the cache every step); this graph returns only the NEW rows, which the
runtime binds straight into its KV arena (runtime/backends/onnx.py).

Graph contract (recorded in the bundle as backend "onnx", params {"precision", "taps", "kv_layout"}):
  inputs   input_ids       int64   (T,)
           position_ids    int64   (T,)              rope positions (a flattened tree repeats depths)
           attention_mask  float32 (T, P+T)          additive: 0 = may attend, -inf = may not
           past_key_{i}    kv      (P, nkv, d)       one per layer i; the first P rows of layer i's K
           past_value_{i}  kv      (P, nkv, d)
  outputs  logits          float32 (T, V)
           tap_<name>      float32 (T, H)            one per exported tap, "layer_in.3" -> tap_layer_in_3
           new_key_{i}     kv      (T, nkv, d)       only the new rows of layer i
           new_value_{i}   kv      (T, nkv, d)
Per-layer K/V inputs let the runtime keep its cache layer-major ((L, max_pos, nkv, d) in the arena), so
each layer's past is one contiguous block bound by pointer: the graph never slices or copies the past.
Attention is grouped per KV head (see `_attention`): no K/V head is repeated.
T and P are dynamic. `kv` is float32 (precision fp32) or float16 (precision fp16).

attention "fused" (the default for fp32 targets): the same contract as "gqa", the graph written node by node
with ONNX Runtime's fused ops (export/onnx/fused.py): a decode step 1.4-2.2x faster on the CPU than this traced graph.

attention "gqa" (`--attention gqa`, params {"attention": "gqa", "kv_layout": "layer_head_major"}): attention is
ONNX Runtime's contrib op GroupQueryAttention (export/onnx/gqa.py) and the K/V are one shared past/present buffer:
  inputs   past_key_{i}    kv      (1, nkv, M, d)    layer i's whole block of the arena, head-major, M = its rows
  outputs  present_key_{i} kv      (1, nkv, M, d)    bound to the SAME memory: the op writes rows [P, P+T)
with P = (attention_mask width) - T; every other input and output as above.

fp16: weights, activations and the K/V are float16; RMSNorm statistics, rope angles and softmax run
in float32 (as HF does under autocast) and logits / taps leave the graph as float32. This halves the
weight bytes a memory-bound decode streams and is the graph TensorRT / the CUDA EP want.

int8 / int4: the fp32 graph with its decoder-layer MatMuls weight-only quantised by ONNX Runtime's
MatMulNBits quantiser (export/onnx/quantize.py); same inputs and outputs (float32), bundle entry
"onnx.int8" / "onnx.int4" next to the float graph's "onnx".

A drafter that is a decoder stack of its own (a draft model) is exported by the same function with
its own spec and weights: it gets its own KV view in the same arena at run time."""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Dict, Mapping, Optional, Sequence

import numpy as np
import onnx
import torch
from torch import nn

from export.library_logs import quiet_library
from runtime.backends.base import parse_tap
from runtime.backends.numpy_ref import NumpyTarget, cache_shape, load_float32, required_weight_names
from runtime.backends.onnx import OnnxTarget, tap_output_name
from runtime.errors import ExportError
from runtime.memory.kv import KVArena
from runtime.model.bundle import give_normal_mode
from runtime.model.layers import rope_inv_freq
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors
from export.onnx.quantize import BITS

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16}
OPSET = 18
KV_LAYOUT = "layer_major"  # the runtime's view of its arena rows: (L, max_pos, nkv, d)
ATTENTION = ("matmul", "gqa")  # grouped attention from MatMuls / ONNX Runtime's GroupQueryAttention
# gqa and fused (export/onnx/fused.py's graph of contrib ops): (L, nkv, max_pos, d), the op's BNSH per layer
KV_LAYOUTS = {"matmul": KV_LAYOUT, "gqa": "layer_head_major", "fused": "layer_head_major"}


def input_names(num_layers: int) -> list:
    return (["input_ids", "position_ids", "attention_mask"] + [f"past_key_{i}" for i in range(num_layers)]
            + [f"past_value_{i}" for i in range(num_layers)])


def output_names(taps: Sequence[str], num_layers: int, attention: str = "matmul") -> list:
    kv = "present" if attention == "gqa" else "new"  # gqa: the whole shared buffer, written in place
    return (["logits"] + [tap_output_name(t) for t in taps] + [f"{kv}_key_{i}" for i in range(num_layers)]
            + [f"{kv}_value_{i}" for i in range(num_layers)])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, d), rotate-half convention (HF Llama/Qwen); cos/sin (T, 1, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderGraph(nn.Module):
    """One decoder-only model as an export-friendly module (see the module docstring for the contract)."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], taps: Sequence[str], precision: str,
                 attention: str = "matmul", names: Optional[Sequence[str]] = None):
        """`names`: the weights to bake in (default: the whole decoder's); a graph built from this one's
        blocks (an MTP module: export/drafters/mtp_onnx.py) names its own. `attention`: one of ATTENTION."""
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.dtype = PRECISIONS[precision]
        self.taps = list(taps)
        for t in self.taps:
            parse_tap(t, spec.num_layers)
        w = load_float32(weights, required_weight_names(spec) if names is None else names, "export")
        self._names: Dict[str, str] = {}
        for name, arr in w.items():
            attr = name.replace(".", "__")
            self.register_buffer(attr, torch.from_numpy(arr.copy()).to(self.dtype), persistent=False)
            self._names[name] = attr
        # The rope inverse frequencies are the numpy reference's (incl. linear / llama3 scaling), baked in.
        self.register_buffer("inv_freq", torch.from_numpy(rope_inv_freq(spec).copy()), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, self._names[name])

    def _linear(self, x: torch.Tensor, name: str, bias: bool = False) -> torch.Tensor:
        y = x @ self.w(name + ".weight").t()
        return y + self.w(name + ".bias") if bias else y

    def _attention(self, q, k, v, past_k, past_v, mask):
        """q (T, nh, d); k/v (T, nkv, d); past_k/v (P, nkv, d); mask (T, P+T) float32 additive -> (T, nh*d).

        Grouped-query attention done per KV head, as runtime.model.layers.attention does it: the g = nh/nkv query
        heads that share KV head n are stacked into one (g*T, d) block, so one batched matmul over the nkv
        KV heads gives every score (exactly the FLOPs needed, no repeated K/V). The past and the new rows
        stay separate inputs (no concat of the cache); only the (nkv, g*T, P+T) scores are joined, so the
        additive mask (any tree) applies to both."""
        s = self.spec
        t, nkv, g, d = q.shape[0], s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        p = past_k.shape[0]
        qg = q.reshape(t, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * t, d)  # (nkv, g*T, d)
        s_past = qg @ past_k.permute(1, 2, 0)  # (nkv, g*T, P)
        s_new = qg @ k.permute(1, 2, 0)  # (nkv, g*T, T)
        scores = torch.cat([s_past, s_new], dim=-1).float() * (1.0 / float(np.sqrt(d)))
        scores = scores.reshape(nkv, g, t, p + t) + mask  # (nkv, g, T, P+T)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).reshape(nkv, g * t, p + t)
        out = probs[..., :p] @ past_v.permute(1, 0, 2) + probs[..., p:] @ v.permute(1, 0, 2)  # (nkv, g*T, d)
        return out.reshape(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, s.num_heads * d)

    def rope(self, position_ids):
        """position_ids (T,) -> cos, sin (T, 1, d) in the graph's dtype."""
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]  # (T, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # (T, 1, d)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def decoder_layer(self, p: str, x, cos, sin, past_k, past_v, mask, bias=None):
        """One decoder layer (weights under prefix `p`) on x (T, H) -> (x', new K, new V (T, nkv, d)).
        attention "gqa": `bias` is the mask as GroupQueryAttention's attention_bias (1, 1, T, P+T) and the
        K/V returned are the op's present buffers (1, nkv, M, d)."""
        s = self.spec
        nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        t = x.shape[0]
        q, k, v = self.attention_inputs(p, x, cos, sin)
        if self.attention == "gqa":
            out, k, v = torch.ops.edgespec.gqa(q.reshape(1, t, nh * d), k.reshape(1, t, nkv * d),
                                               v.reshape(1, t, nkv * d), past_k, past_v, bias, nh, nkv)
            attn = out.reshape(t, nh * d)
        else:
            attn = self._attention(q, k, v, past_k, past_v, mask)
        return self.after_attention(p, x, attn), k, v

    def attention_inputs(self, p: str, x, cos, sin):
        """A decoder layer's opening on x (T, H): input norm, Q/K/V projections, Q/K norms (Qwen3), rotary at the
        rows' positions -> q (T, nh, d), k, v (T, nkv, d). Every graph of a decoder layer starts so (the K-step
        graph's too, export/onnx/kstep.py), so that they all compute the numpy reference's layer."""
        s = self.spec
        nh, nkv, d, eps = s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        t = x.shape[0]
        h = rms_norm(x, self.w(p + "input_layernorm.weight"), eps)
        q = self._linear(h, p + "self_attn.q_proj", s.qkv_bias).reshape(t, nh, d)
        k = self._linear(h, p + "self_attn.k_proj", s.qkv_bias).reshape(t, nkv, d)
        v = self._linear(h, p + "self_attn.v_proj", s.qkv_bias).reshape(t, nkv, d)
        if s.qk_norm:
            q = rms_norm(q, self.w(p + "self_attn.q_norm.weight"), eps)
            k = rms_norm(k, self.w(p + "self_attn.k_norm.weight"), eps)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def after_attention(self, p: str, x, attn):
        """A decoder layer's close: x (T, H) + o_proj(attn (T, nh*d)), then the post-attention norm's SwiGLU MLP."""
        x = x + self._linear(attn, p + "self_attn.o_proj")
        h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), self.spec.rms_norm_eps)
        gate = self._linear(h, p + "mlp.gate_proj")
        return x + self._linear(torch.nn.functional.silu(gate) * self._linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")

    def forward(self, input_ids, position_ids, attention_mask, past_keys, past_values):
        s = self.spec
        cos, sin = self.rope(position_ids)
        x = self.w("model.embed_tokens.weight")[input_ids]  # (T, H)
        bias = attention_mask.to(self.dtype).reshape(1, 1, input_ids.shape[0], -1) if self.attention == "gqa" else None
        taps: Dict[str, torch.Tensor] = {}
        new_k, new_v = [], []
        for i in range(s.num_layers):
            taps[f"layer_in.{i}"] = x
            x, k, v = self.decoder_layer(f"model.layers.{i}.", x, cos, sin, past_keys[i], past_values[i], attention_mask,
                                         bias)
            new_k.append(k)
            new_v.append(v)
            taps[f"layer_out.{i}"] = x
        h = rms_norm(x, self.w("model.norm.weight"), s.rms_norm_eps)
        taps["final_norm"] = h
        head = self.w("model.embed_tokens.weight") if s.tie_word_embeddings else self.w("lm_head.weight")
        logits = (h @ head.t()).float()  # (T, V)
        return (logits, *[taps[n].float() for n in self.taps], *new_k, *new_v)  # L x (T, nkv, d) or gqa's presents


def export_decoder_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str,
                        taps: Sequence[str] = ("final_norm",), precision: str = "fp32", attention: str = "matmul") -> str:
    """Export any decoder stack (target or draft model) to `out_path` (+ `out_path`.data with the weights).
    Returns out_path. The graph is checked with onnx.checker before returning."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {sorted(PRECISIONS)}")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: expected one of {list(ATTENTION)}")
    module = DecoderGraph(spec, weights, taps, precision, attention).eval()
    dt = PRECISIONS[precision]
    shape = cache_shape(spec)
    t, p, m = 3, 5, 11  # example sizes; all exported as dynamic (avoid 0/1, which torch.export specialises)
    kv = (1, shape.num_kv_heads, m, shape.head_dim) if attention == "gqa" else (p, shape.num_kv_heads, shape.head_dim)
    layers = range(spec.num_layers)
    args = (torch.zeros(t, dtype=torch.int64), torch.arange(p, p + t), torch.zeros(t, p + t),
            [torch.zeros(kv, dtype=dt) for _ in layers], [torch.zeros(kv, dtype=dt) for _ in layers])
    T, P, S = torch.export.Dim("T"), torch.export.Dim("P"), torch.export.Dim("S")  # S = P+T, inferred (matmul)
    rows = {2: torch.export.Dim("M")} if attention == "gqa" else {0: P}
    dynamic = {"input_ids": {0: T}, "position_ids": {0: T}, "attention_mask": {0: T, 1: S},
               "past_keys": [rows for _ in layers], "past_values": [rows for _ in layers]}
    translation = {}
    if attention == "gqa":
        from export.onnx import gqa as onnx_gqa
        onnx_gqa.register_schema()
        translation = onnx_gqa.TRANSLATION
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():  # torch.onnx's notes and warnings about itself (--verbose shows them)
        program = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET,
                                    input_names=input_names(spec.num_layers),
                                    output_names=output_names(taps, spec.num_layers, attention),
                                    dynamic_shapes=dynamic, custom_translation_table=translation, verbose=False)
    return save_program(program, out_path)


def save_program(program, out_path: str) -> str:
    """Write a torch.onnx export to `out_path` + `out_path`.data, checked with onnx.checker."""
    # Save through a scratch directory, then re-save with one data file of a fixed name (the bundle
    # lists it). onnx appends to an existing data file, so stale files are removed first.
    data = os.path.basename(out_path) + ".data"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out_path))) as scratch:
        with quiet_library():  # the optimiser's notes on its own passes
            program.save(os.path.join(scratch, "graph.onnx"), external_data=True)
        model = onnx.load(os.path.join(scratch, "graph.onnx"))
    for stale in (out_path, out_path + ".data"):
        if os.path.exists(stale):
            os.remove(stale)
    save_onnx(model, out_path, data)
    return out_path


def save_onnx(model, out_path: str, data: str) -> None:
    """onnx.save with every weight in the one data file `data` (a name beside out_path), checked; both files
    get the mode a normal write gives (onnx's external-data writer creates its file 0o600)."""
    onnx.save(model, out_path, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
              size_threshold=1024)
    give_normal_mode(*[p for p in (out_path, os.path.join(os.path.dirname(out_path), data)) if os.path.exists(p)])
    onnx.checker.check_model(out_path, full_check=False)


def export_target_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str,
                       taps: Sequence[str] = ("final_norm",), precision: str = "fp32", attention: str = "matmul") -> str:
    """The target model as an ONNX graph (see the module docstring for inputs/outputs)."""
    return export_decoder_onnx(spec, weights, out_path, taps, precision, attention)


def export_draft_model_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str,
                            precision: str = "fp32", attention: str = "matmul") -> str:
    """A draft model (a small decoder of the target's tokenizer) is one more decoder stack, no taps."""
    return export_decoder_onnx(spec, weights, out_path, (), precision, attention)


def graph_weight_bytes(graph_path: str) -> int:
    """Bytes of every weight a graph holds once ONNX Runtime loads it: its inline initializers and constants, and
    the length of each external one wherever it lies (its own data file or one it shares: `share_initializers`).
    A session of its own loads all of them again, so this is what the memory plan counts for a second session
    (runtime/drafters/shared.py kstep_memory)."""
    model = onnx.load(graph_path, load_external_data=False)
    folder = os.path.dirname(os.path.abspath(graph_path))
    total = 0
    tensors = list(model.graph.initializer)
    tensors += [a.t for node in model.graph.node if node.op_type == "Constant" for a in node.attribute if a.type == a.TENSOR]
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            total += int(info["length"]) if "length" in info else os.path.getsize(os.path.join(folder, info["location"]))
        else:
            total += len(t.raw_data) or int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(
                t.data_type).itemsize
    return total


def share_initializers(graph_path: str, source_path: str, min_bytes: int = 4096) -> int:
    """Point every weight of `graph_path` that is byte-identical to an external weight of `source_path`
    (e.g. a drafter's copy of the target's embedding / LM head) at the source's data file, at the same
    offset, and rewrite the graph's own data file without it: one copy of the vocab-sized matrices per
    bundle. Both graphs must sit in the same directory. Returns how many tensors are now shared."""
    folder = os.path.dirname(os.path.abspath(source_path))
    if os.path.dirname(os.path.abspath(graph_path)) != folder:
        raise ValueError(f"{graph_path} and {source_path} must be in the same directory to share data files")
    index = {}
    for init in onnx.load(source_path, load_external_data=False).graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        with open(os.path.join(folder, info["location"]), "rb") as f:
            f.seek(int(info.get("offset", 0)))
            blob = f.read(int(info["length"]))
        index[(init.data_type, tuple(init.dims), hashlib.sha256(blob).hexdigest())] = info
    model = onnx.load(graph_path)  # with its data
    shared = 0
    for init in model.graph.initializer:
        raw = init.raw_data
        if len(raw) < min_bytes:
            continue
        info = index.get((init.data_type, tuple(init.dims), hashlib.sha256(raw).hexdigest()))
        if info is None:
            continue
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL
        del init.external_data[:]
        for key in ("location", "offset", "length"):
            if key in info:
                init.external_data.add(key=key, value=info[key])
        shared += 1
    own = os.path.basename(graph_path) + ".data"
    os.remove(graph_path + ".data")
    save_onnx(model, graph_path, own)
    return shared


def reference_cases(spec: ModelSpec, seed: int = 0):
    """A few (prefix, tokens, positions, mask) cases: prefill, one decode step, a 4-node tree."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, spec.vocab_size, 12)
    p = len(prefix)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    return [
        ("prefill", prefix[:0], prefix, np.arange(p), None),
        ("decode", prefix, rng.integers(0, spec.vocab_size, 1), np.array([p]), None),
        ("tree", prefix, rng.integers(0, spec.vocab_size, 4), np.array([p, p + 1, p + 1, p + 2]),
         np.concatenate([np.ones((4, p), bool), tree], axis=1)),
    ]


def validate_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], onnx_path: str,
                  taps: Sequence[str] = ("final_norm",), precision: str = "fp32", verbose: bool = True) -> float:
    """Run the exported graph through OnnxTarget and the numpy reference on a few inputs; print and
    return the max relative error over logits and taps (|a-b|max / |b|max). A quantised graph (int8/int4)
    is compared with the float32 reference (its error is the quantisation's)."""
    kv_dtype = np.float16 if precision == "fp16" else np.float32
    worst = 0.0
    for name, prefix, tokens, positions, mask in reference_cases(spec):
        n = len(prefix) + len(tokens)
        ref = NumpyTarget(spec, weights, KVArena.for_context({"t": cache_shape(spec)}, n).allocate("t", cache_shape(spec), n))
        ort = OnnxTarget(spec, onnx_path, KVArena.for_context({"t": cache_shape(spec)}, n, kv_dtype)
                         .allocate("t", cache_shape(spec), n), tap_names=taps)
        if len(prefix):
            ref.forward(prefix, np.arange(len(prefix)))
            ort.forward(prefix, np.arange(len(prefix)))
        a, b = ort.forward(tokens, positions, mask, taps), ref.forward(tokens, positions, mask, taps)
        errs = {"logits": _rel(a.logits, b.logits), **{t: _rel(a.taps[t], b.taps[t]) for t in taps}}
        worst = max(worst, *errs.values())
        if verbose:
            print(f"  {name:8s} T={len(tokens):2d} P={len(prefix):2d}  " +
                  "  ".join(f"{k} max rel err {v:.2e}" for k, v in errs.items()))
    if verbose:
        print(f"{onnx_path}: max rel error vs numpy reference {worst:.2e} ({precision})")
    return worst


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float32) - b)) / max(float(np.max(np.abs(b))), 1e-12))


def safetensors_weights(b, files: Sequence[str]) -> Dict[str, np.ndarray]:
    weights: Dict[str, np.ndarray] = {}
    for rel in files:
        if rel.endswith(".safetensors"):
            weights.update(read_safetensors(b.path(rel)))
    return weights


# The largest max relative error (logits and taps, see validate_onnx) an export may show against the numpy
# reference; above it `edgespec export` refuses the graphs and leaves the bundle as it was. fp32 graphs measure
# ~1e-6 (summation order), fp16 ~3e-3. A weight-only quantised graph is compared with the same float32
# reference, so its bound only catches a broken graph (error ~1): the zoo measured 8e-3 (int8) and 1.2e-1
# (int4, block 32), the random-weight test model 6.5e-2 (int8).
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "int8": 2e-1, "int4": 5e-1}


def check_against_reference(label: str, err: float, precision: str) -> None:
    """Raise ExportError when a graph's max relative error `err` exceeds what its precision allows."""
    if err <= TOLERANCE[precision]:  # NaN fails too
        return
    why = ("quantisation moved this model further than that; try a smaller --block-size, or int8 for int4"
           if precision in BITS else "the exporter does not reproduce this model; report it with the bundle's spec")
    raise ExportError(f"{label}: the exported {precision} graph differs from the numpy reference by {err:.2e} "
                      f"(max relative error over logits and taps; {precision} allows {TOLERANCE[precision]:.0e}). "
                      f"The bundle was left unchanged: {why} (`--no-validate` writes the graphs anyway)")
