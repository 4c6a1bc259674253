"""The lean target graph (`edgespec export --to onnx`, attention "fused": the default for an fp32 target): a decoder
written node by node with ONNX Runtime's fused contrib ops, as onnxruntime-genai's model builder writes its graphs,
on edgespec's contract.

Per layer, where the traced graph (export/onnx/graph.py) has ~70 nodes (RMSNorm as Pow/ReduceMean/Sqrt/
Reciprocal/Mul, rope as Slice/Neg/Concat/Mul/Add, attention as MatMul/Softmax/Concat/Transpose), this one has 8:

    SkipSimplifiedLayerNormalization  (residual add + RMSNorm in one; its 4th output is the residual sum,
                                       which is what the taps layer_in.i / layer_out.i read)
    MatMul qkv                        (q, k, v weights packed side by side: one GEMV instead of three)
    GroupQueryAttention               (rope inside the op from a cos/sin table and position_ids, the tree mask
                                       as attention_bias, past/present K/V one shared buffer written in place)
    MatMul o, SkipSimplifiedLayerNormalization, MatMul gate, MatMul up, Sigmoid, Mul, Mul, MatMul down

Inputs and outputs are the "gqa" graph's (export/onnx/graph.py's docstring), so runtime/backends/onnx.py runs it
unchanged: input_ids / position_ids (T,), attention_mask float32 (T, P+T) additive, past_key_i / past_value_i
(1, nkv, M, d) bound to the same memory as present_key_i / present_value_i, logits float32 (R, V); each
tap_<name> is float32 (1, T, H), the layer's own tensor (no node runs for a tap), bound as the backend's (T, H).
One more input, logits_from int64 (1,), makes logits the rows [logits_from, T) only: (T - logits_from, V).

The rope table holds ROPE_POSITIONS(spec) positions (recorded as the graph's metadata "rope_positions", which
the backend checks each step: the op does not). qk-norm models (Qwen3) split the packed projection and normalise
q and k per head with SimplifiedLayerNormalization before the op. Checked against the numpy reference at export
(export/onnx/bundle.py), as every graph is."""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.onnx.graph import input_names, output_names
from runtime.backends.base import parse_tap
from runtime.backends.numpy_ref import load_float32, required_weight_names
from runtime.backends.onnx import tap_output_name
from runtime.model.bundle import give_normal_mode
from runtime.model.layers import rope_inv_freq
from runtime.model.spec import ModelSpec

OPSET = 18
MSFT = "com.microsoft"
ROPE_METADATA = "rope_positions"
CAUSAL_METADATA = "attention_is_causal"  # "1": the op applies the causal mask, the bias only narrows it (trees)
LOGITS_FROM = "logits_from"  # int64 (1,): logits leave the graph for rows [logits_from, T) only
_NP = {"fp32": np.float32, "fp16": np.float16}
_ONNX = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


def rope_positions(spec: ModelSpec) -> int:
    """Rows of the graph's cos/sin table: the model's positions, with room for a context run past them."""
    return max(2 * spec.max_position_embeddings, 8192)


def rope_tables(spec: ModelSpec, positions: int):
    """cos, sin (positions, d/2) float32 of the numpy reference's inverse frequencies (incl. llama3 / linear
    scaling): GroupQueryAttention's cos_cache / sin_cache (rotate-half convention, rotary_interleaved=0)."""
    freqs = np.arange(positions, dtype=np.float64)[:, None] * rope_inv_freq(spec).astype(np.float64)[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


class _Graph:
    """Nodes and initializers being collected; `node` returns its output names."""

    def __init__(self, dtype: str):
        self.nodes: List[onnx.NodeProto] = []
        self.inits: List[onnx.TensorProto] = []
        self.np_dtype, self.onnx_dtype = _NP[dtype], _ONNX[dtype]

    def const(self, name: str, arr: np.ndarray, cast: bool = True) -> str:
        arr = np.ascontiguousarray(arr.astype(self.np_dtype) if cast else arr)
        self.inits.append(onnx.numpy_helper.from_array(arr, name))
        return name

    def node(self, op: str, inputs: Sequence[str], name: str, outputs: int = 1, domain: str = "",
             named: Mapping[int, str] = {}, unused: Sequence[int] = (), **attrs):
        """`named`: {output index: graph output name} for outputs written straight into bound memory; `unused`:
        optional outputs left unnamed (""), which the op then does not compute."""
        outs = ["" if i in unused else named.get(i, f"{name}/out{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def out(self, src: str, name: str) -> str:
        """Graph output `name`: `src` itself in float32 graphs, a Cast of it in float16 ones."""
        if self.onnx_dtype == TensorProto.FLOAT:
            for node in self.nodes:  # rename the producer's output: no copy between the op and the bound buffer
                node.output[:] = [name if o == src else o for o in node.output]
                node.input[:] = [name if i == src else i for i in node.input]
        else:
            self.nodes.append(helper.make_node("Cast", [src], [name], name=f"{name}/cast", to=TensorProto.FLOAT))
        return name


# SkipSimplifiedLayerNormalization's outputs: 0 the normalised sum, 1 / 2 its mean and inverse std (training
# outputs: named, the kernel computes and stores them every step: ~30 % of the op's time, 1-2 % of a step
# measured on the stand-in), 3 the residual sum.
SKIP_NORM = dict(outputs=4, domain=MSFT, unused=(1, 2))


def _weights_t(w: Mapping[str, np.ndarray], *names: str) -> np.ndarray:
    """The (out, in) torch Linear weights `names`, transposed and packed side by side: (in, sum of outs)."""
    return np.concatenate([w[n].T for n in names], axis=1)


def build_fused_model(spec: ModelSpec, weights: Mapping[str, np.ndarray], taps: Sequence[str] = ("final_norm",),
                      precision: str = "fp32") -> onnx.ModelProto:
    """The fused decoder graph (module docstring) as an in-memory ModelProto."""
    if precision not in _NP:
        raise ValueError(f"precision {precision!r}: the fused graph is built in {sorted(_NP)} (int8/int4 quantise "
                         "the matmul graph)")
    for t in taps:
        parse_tap(t, spec.num_layers)
    s = spec
    nh, nkv, d, eps, n = s.num_heads, s.num_kv_heads, s.head_dim, float(s.rms_norm_eps), s.num_layers
    w = load_float32(weights, required_weight_names(spec), "export")
    g = _Graph(precision)
    dt = g.onnx_dtype
    cos, sin = rope_tables(spec, rope_positions(spec))
    g.const("cos_cache", cos)
    g.const("sin_cache", sin)
    g.const("axis0", np.array([0], np.int64), cast=False)
    g.const("axes01", np.array([0, 1], np.int64), cast=False)
    g.const("one", np.array([1], np.int64), cast=False)
    embed = g.const("embed", w["model.embed_tokens.weight"])  # (V, H)
    x = g.node("Gather", [embed, g.node("Unsqueeze", ["input_ids", "axis0"], "ids")], "embed_gather")  # (1, T, H)
    pos = g.node("Unsqueeze", ["position_ids", "axis0"], "positions")  # (1, T)
    bias = g.node("Unsqueeze", ["attention_mask", "axes01"], "bias")  # (1, 1, T, S) float32 additive
    if dt != TensorProto.FLOAT:
        bias = g.node("Cast", [bias], "bias_cast", to=dt)
    total = g.node("Shape", ["attention_mask"], "total", start=1, end=2)  # (1,) int64: S = P + T
    seqlens_k = g.node("Cast", [g.node("Sub", [total, "one"], "total_minus_1")], "seqlens_k", to=TensorProto.INT32)
    total_len = g.node("Cast", [g.node("Squeeze", [total], "total_scalar")], "total_len", to=TensorProto.INT32)

    tap_src = {}
    residual, delta = x, None
    for i in range(n):
        p = f"model.layers.{i}."
        if delta is None:
            norm = g.const(f"l{i}.in_norm", w[p + "input_layernorm.weight"])
            h = g.node("SimplifiedLayerNormalization", [residual, norm], f"l{i}/in_norm", axis=-1, epsilon=eps,
                       stash_type=1)
        else:
            h, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                       [residual, delta, g.const(f"l{i}.in_norm", w[p + "input_layernorm.weight"])],
                                       f"l{i}/in_norm", epsilon=eps, **SKIP_NORM)
        tap_src[f"layer_in.{i}"] = residual
        if i:
            tap_src[f"layer_out.{i - 1}"] = residual
        a = p + "self_attn."
        qkv = g.node("MatMul", [h, g.const(f"l{i}.qkv", _weights_t(w, a + "q_proj.weight", a + "k_proj.weight",
                                                                   a + "v_proj.weight"))], f"l{i}/qkv")
        if s.qkv_bias:
            qkv = g.node("Add", [qkv, g.const(f"l{i}.qkv_bias", np.concatenate(
                [w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))], f"l{i}/qkv_bias")
        if s.qk_norm:  # per-head RMSNorm of q and k before the op's rope: the packed projection split in three
            g.const(f"l{i}.split_qkv", np.array([nh * d, nkv * d, nkv * d], np.int64), cast=False)
            q, k, v = g.node("Split", [qkv, f"l{i}.split_qkv"], f"l{i}/split_qkv", outputs=3, axis=-1)
            q, k = (_head_norm(g, t, heads, g.const(f"l{i}.{nm}", w[a + f"{nm}.weight"]), d, eps, f"l{i}/{nm}")
                    for t, heads, nm in ((q, nh, "q_norm"), (k, nkv, "k_norm")))
            attn_in = [q, k, v]
        else:
            attn_in = [qkv, "", ""]  # packed: the op splits q | k | v itself
        # present_key_i IS the graph output bound to past_key_i's memory: the op then writes the new rows in place
        attn = g.node("GroupQueryAttention",
                      attn_in + [f"past_key_{i}", f"past_value_{i}", seqlens_k, total_len, "cos_cache", "sin_cache",
                                 pos, bias], f"l{i}/gqa", outputs=3, domain=MSFT,
                      named={1: f"present_key_{i}", 2: f"present_value_{i}"}, num_heads=nh, kv_num_heads=nkv,
                      do_rotary=1, rotary_interleaved=0, scale=float(1.0 / np.sqrt(d)))[0]
        o = g.node("MatMul", [attn, g.const(f"l{i}.o", _weights_t(w, a + "o_proj.weight"))], f"l{i}/o")
        h, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                   [residual, o, g.const(f"l{i}.post_norm", w[p + "post_attention_layernorm.weight"])],
                                   f"l{i}/post_norm", epsilon=eps, **SKIP_NORM)
        m = p + "mlp."
        # gate and up stay two MatMuls: packed, the Split after them copied more than the one GEMV saved
        gate = g.node("MatMul", [h, g.const(f"l{i}.gate", _weights_t(w, m + "gate_proj.weight"))], f"l{i}/gate")
        up = g.node("MatMul", [h, g.const(f"l{i}.up", _weights_t(w, m + "up_proj.weight"))], f"l{i}/up")
        silu = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"l{i}/sigmoid")], f"l{i}/silu")
        act = g.node("Mul", [silu, up], f"l{i}/act")
        delta = g.node("MatMul", [act, g.const(f"l{i}.down", _weights_t(w, m + "down_proj.weight"))], f"l{i}/down")
    final, _, _, residual = g.node("SkipSimplifiedLayerNormalization",
                                   [residual, delta, g.const("final_norm", w["model.norm.weight"])], "final_norm",
                                   epsilon=eps, **SKIP_NORM)
    tap_src[f"layer_out.{n - 1}"] = residual
    tap_src["final_norm"] = final
    # (H, V): a Transpose of the embedding when tied (folded once at session load, one copy on disk)
    head = (g.node("Transpose", [embed], "head_t", perm=[1, 0]) if s.tie_word_embeddings
            else g.const("lm_head", w["lm_head.weight"].T))
    outs = output_names(taps, n, "gqa")
    # 2-D before the head: the (T, V) product is the bound logits buffer itself. Only rows [logits_from, T) reach
    # the head (0 for a verify; a prefill asks for its last row alone, not T x V rows it would drop).
    g.const("rows_end", np.array([np.iinfo(np.int64).max], np.int64), cast=False)
    rows = g.node("Slice", [g.node("Squeeze", [final, "axis0"], "final_2d"), LOGITS_FROM, "rows_end", "axis0"],
                  "logit_rows")  # (R, H)
    g.out(g.node("MatMul", [rows, head], "lm_head"), "logits")
    # A tap is its layer's own (1, T, H) tensor, renamed: ONNX Runtime runs every node of a graph whether or not
    # its output is bound, so a Squeeze per tap would run on every step that reads no tap (plain decoding).
    # layer_in.{i+1} and layer_out.{i} are one tensor: a second tap of it is an Identity (runs only when both are).
    named: Dict[str, str] = {}
    for t in taps:
        src = tap_src[t]
        if src in named:
            g.nodes.append(helper.make_node("Identity", [named[src]], [tap_output_name(t)], name=f"{t}/alias"))
        else:
            named[src] = g.out(src, tap_output_name(t))
    kv_shape = [1, nkv, "M", d]
    inputs = ([helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["T"]),
               helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["T"]),
               helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["T", "S"])]
              + [helper.make_tensor_value_info(nm, dt, kv_shape) for nm in input_names(n)[3:]]
              + [helper.make_tensor_value_info(LOGITS_FROM, TensorProto.INT64, [1])])
    out_info = []
    for nm in outs:
        if nm.startswith("present_"):
            out_info.append(helper.make_tensor_value_info(nm, dt, kv_shape))
        else:
            shape = ["R", s.vocab_size] if nm == "logits" else [1, "T", s.hidden_size]
            out_info.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, shape))
    graph = helper.make_graph(g.nodes, "edgespec_fused_decoder", inputs, out_info, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MSFT, 1)],
                              producer_name="edgespec")
    model.ir_version = 8
    # GroupQueryAttention's causal=1 (its default) masks the future rows itself: a causal forward's bias is all 0
    helper.set_model_props(model, {ROPE_METADATA: str(rope_positions(spec)), CAUSAL_METADATA: "1"})
    return model


def _head_norm(g: _Graph, x: str, heads: int, weight: str, d: int, eps: float, name: str) -> str:
    """(1, T, heads*d) -> RMSNorm over each head's d values -> (1, T, heads*d)."""
    g.const(f"{name}.heads", np.array([0, 0, heads, d], np.int64), cast=False)
    g.const(f"{name}.flat", np.array([0, 0, heads * d], np.int64), cast=False)
    y = g.node("SimplifiedLayerNormalization", [g.node("Reshape", [x, f"{name}.heads"], f"{name}/heads"), weight],
               name, axis=-1, epsilon=eps, stash_type=1)
    return g.node("Reshape", [y, f"{name}.flat"], f"{name}/flat")


def export_fused_onnx(spec: ModelSpec, weights: Mapping[str, np.ndarray], out_path: str,
                      taps: Sequence[str] = ("final_norm",), precision: str = "fp32") -> str:
    """Write the fused graph to `out_path` (+ `out_path`.data with the weights); returns out_path."""
    model = build_fused_model(spec, weights, taps, precision)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    for stale in (out_path, out_path + ".data"):
        if os.path.exists(stale):
            os.remove(stale)
    # Not onnx.checker: SimplifiedLayerNormalization is ONNX Runtime's op in the default domain, which onnx has no
    # schema for; ONNX Runtime loading the graph (and the check against the numpy reference) is the check.
    onnx.save(model, out_path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=os.path.basename(out_path) + ".data", size_threshold=1024)
    give_normal_mode(*[f for f in (out_path, out_path + ".data") if os.path.exists(f)])
    return out_path
