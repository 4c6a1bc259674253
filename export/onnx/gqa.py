"""Attention through ONNX Runtime's contrib op com.microsoft.GroupQueryAttention (`edgespec export --to onnx
--attention gqa`).

The op groups query heads per KV head itself and, given the SAME buffer as past and present K/V
("past_present_share_buffer"), reads the past and writes only the new rows in place: the runtime binds each
layer's block of its arena, seen head-major as (1, nkv, max_pos, d) (kv_layout "layer_head_major"), as both
input past_key_i and output present_key_i. The op takes the total length from `seqlens_k` (= P + T - 1) and
`total_sequence_length`, both derived in the graph from the attention mask's width, so the graph's inputs
are the matmul graph's. `causal=0` plus the additive mask as `attention_bias` (1, 1, T, P+T) keeps any tree
mask. It is the op the CUDA provider runs as a fused (flash / memory-efficient) kernel.

How it gets into the graph: a torch custom op `edgespec::gqa` (eager maths below, only for running the module
in torch) and a translation for torch.onnx's dynamo exporter that emits the contrib node. onnx has no schema
for com.microsoft ops, so `register_schema` declares the inputs/attributes this export uses (ONNX Runtime's
own schema is the full one: `onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema()`)."""
from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema
from onnxscript import opset18 as op

DOMAIN = "com.microsoft"
_msft = onnxscript.values.Opset(DOMAIN, 1)


def register_schema() -> None:
    """Declare GroupQueryAttention (the first 11 inputs, 3 outputs) to onnx once per process, so that the
    exporter can emit it and onnx.checker can check it."""
    try:
        onnx.defs.get_schema("GroupQueryAttention", 1, DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    p, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [p("query", "T"), p("key", "T", param_option=opt), p("value", "T", param_option=opt),
              p("past_key", "T", param_option=opt), p("past_value", "T", param_option=opt),
              p("seqlens_k", "M"), p("total_sequence_length", "M"), p("cos_cache", "T", param_option=opt),
              p("sin_cache", "T", param_option=opt), p("position_ids", "I", param_option=opt),
              p("attention_bias", "T", param_option=opt)]
    outputs = [p("output", "T"), p("present_key", "T"), p("present_value", "T")]
    types = [("T", ["tensor(float)", "tensor(float16)"], ""), ("M", ["tensor(int32)"], ""), ("I", ["tensor(int64)"], "")]
    attrs = [OpSchema.Attribute(name, OpSchema.AttrType.INT, "") for name in ("num_heads", "kv_num_heads", "causal")]
    onnx.defs.register_schema(OpSchema("GroupQueryAttention", DOMAIN, 1, inputs=inputs, outputs=outputs,
                                       type_constraints=types, attributes=attrs))


@torch.library.custom_op("edgespec::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        bias: torch.Tensor, num_heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (1, T, nh*d); k/v (1, T, nkv*d); past_k/v (1, nkv, M, d) with P = S - T rows valid; bias (1, 1, T, S)
    -> out (1, T, nh*d), present_k/v (1, nkv, M, d) = past with the new rows at [P, S)."""
    t, s = q.shape[1], bias.shape[-1]
    d = past_k.shape[-1]
    g = num_heads // kv_heads
    present_k, present_v = past_k.clone(), past_v.clone()
    present_k[0, :, s - t:s] = k[0].reshape(t, kv_heads, d).transpose(0, 1)
    present_v[0, :, s - t:s] = v[0].reshape(t, kv_heads, d).transpose(0, 1)
    qh = q[0].reshape(t, kv_heads, g, d).permute(1, 2, 0, 3).reshape(kv_heads, g * t, d)  # (nkv, g*T, d)
    scores = (qh @ present_k[0, :, :s].transpose(1, 2)).float() / d ** 0.5  # (nkv, g*T, S)
    scores = scores.reshape(kv_heads, g, t, s) + bias[0, 0].float()
    probs = torch.softmax(scores, dim=-1).to(q.dtype).reshape(kv_heads, g * t, s)
    out = (probs @ present_v[0, :, :s]).reshape(kv_heads, g, t, d).permute(2, 0, 1, 3).reshape(1, t, num_heads * d)
    return out, present_k, present_v


@gqa.register_fake
def _gqa_shapes(q, k, v, past_k, past_v, bias, num_heads, kv_heads):
    return torch.empty_like(q), torch.empty_like(past_k), torch.empty_like(past_v)


def _gqa_onnx(q, k, v, past_k, past_v, bias, num_heads: int, kv_heads: int):
    """The com.microsoft node; seqlens_k = S - 1 and total_sequence_length = S from the bias's width."""
    total = op.Shape(bias, start=3, end=4)  # (1,) int64: S = P + T
    seqlens_k = op.Cast(op.Sub(total, op.Constant(value_ints=[1])), to=onnx.TensorProto.INT32)
    total_len = op.Cast(op.Squeeze(total), to=onnx.TensorProto.INT32)
    return _msft.GroupQueryAttention(q, k, v, past_k, past_v, seqlens_k, total_len, None, None, None, bias,
                                     num_heads=num_heads, kv_num_heads=kv_heads, causal=0)


TRANSLATION = {torch.ops.edgespec.gqa.default: _gqa_onnx}
