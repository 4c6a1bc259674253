"""Weight-only int8 / int4 quantization of an exported decoder graph, in the form TensorRT builds weight-only GEMMs
from: each decoder-layer projection weight becomes an integer initializer and a DequantizeLinear node
(MatMul(x, DQ(W_q, scale))), activations and the KV cache keep the graph's precision.

  int8: symmetric, one scale per output column (DequantizeLinear axis=1 over W (K, N)).
  int4: symmetric, one scale per block of `block` input rows per output column (DequantizeLinear axis=0,
        block_size, opset 21), the AWQ / GPTQ layout; K must divide into blocks.

Only 2-D weights that feed exactly one MatMul as its B input are quantized: the q/k/v/o and MLP projections. The
embedding and the tied LM head stay in the graph's precision (as int4 runtimes keep them; see runtime/memory/plan.py).
The graph's opset rises to 21 (DequantizeLinear with a float16 scale and output, int4 and block_size); the ops an
edgespec export uses mean the same at 18 and 21. Lossy: these are options whose name says the precision, and a
quantized target is a different target (exactness holds against it, not against the fp16 one)."""
from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from runtime.model.bundle import give_normal_mode

WEIGHT_BITS = {"int8": 8, "int4": 4}
OPSET = 21


def quantize_int8(w: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """W (K, N) -> (int8 (K, N), scale (N,)), W ~= q * scale; scale = max|column| / 127 (1 for an all-zero column).
    quantize_int8(np.array([[1.0, -2.0], [0.5, 4.0]])) -> q [[127, -64], [64, 127]], scale [1/127, 4/127]."""
    w = w.astype(np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale[scale == 0] = 1.0
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def quantize_int4(w: np.ndarray, block: int) -> Tuple[np.ndarray, np.ndarray]:
    """W (K, N) -> (int4 values in int8 (K, N), scale (K/block, N)); scale = max|block| / 7 per block of rows."""
    k, n = w.shape
    blocks = w.astype(np.float32).reshape(k // block, block, n)
    scale = np.abs(blocks).max(axis=1) / 7.0  # (K/block, N)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(blocks / scale[:, None, :]), -7, 7).astype(np.int8)
    return q.reshape(k, n), scale


def int4_tensor(name: str, q: np.ndarray) -> TensorProto:
    """An INT4 initializer from values in [-8, 7], packed two per byte, first element in the low nibble (ONNX)."""
    flat = q.reshape(-1).astype(np.int16) & 0xF
    if flat.size % 2:
        flat = np.append(flat, 0)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    t = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(q.shape))
    t.raw_data = packed.tobytes()
    return t


def int4_block(k: int) -> int:
    """The int4 block along K: 128 (the usual AWQ / GPTQ group) or the largest power of two >= 16 dividing K."""
    for b in (128, 64, 32, 16):
        if k % b == 0:
            return b
    return 0


def quantize_graph(src: str, dst: str, weights: str) -> Dict[str, int]:
    """Write `dst` (+ `dst`.data): `src` with its projection weights quantized to `weights` ("int8" or "int4").
    Returns {"quantized": count, "kept": count, "bytes_before": B, "bytes_after": B} over the candidate weights."""
    if weights not in WEIGHT_BITS:
        raise ValueError(f"weights {weights!r}: expected one of {sorted(WEIGHT_BITS)}")
    model = onnx.load(src)  # with its external data
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    uses: Dict[str, int] = {}
    for node in graph.node:
        for i in node.input:
            uses[i] = uses.get(i, 0) + 1
    stats = {"quantized": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    new_nodes = []
    for node in graph.node:
        b = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        t = inits.get(b) if b else None
        if t is None or len(t.dims) != 2 or uses.get(b) != 1 or t.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(t)
        stats["bytes_before"] += w.nbytes
        block = int4_block(w.shape[0]) if weights == "int4" else 0
        if weights == "int4" and not block:
            stats["kept"] += 1
            stats["bytes_after"] += w.nbytes
            new_nodes.append(node)
            continue
        if weights == "int8":
            q, scale = quantize_int8(w)
            q_t, attrs = numpy_helper.from_array(q, b + "_q"), {"axis": 1}
        else:
            q, scale = quantize_int4(w, block)
            q_t, attrs = int4_tensor(b + "_q", q), {"axis": 0, "block_size": block}
        s_t = numpy_helper.from_array(scale.astype(w.dtype), b + "_scale")  # DQ's output takes the scale's type
        graph.initializer.remove(t)
        graph.initializer.extend([q_t, s_t])
        new_nodes.append(helper.make_node("DequantizeLinear", [q_t.name, s_t.name], [b + "_dq"], name=b + "_dq", **attrs))
        node.input[1] = b + "_dq"
        new_nodes.append(node)
        stats["quantized"] += 1
        stats["bytes_after"] += (q.size * WEIGHT_BITS[weights] + 7) // 8 + scale.size * w.dtype.itemsize
    del graph.node[:]
    graph.node.extend(new_nodes)
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, OPSET)
    if model.ir_version < 10:
        model.ir_version = 10  # INT4 needs IR 10
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    for stale in (dst, dst + ".data"):
        if os.path.exists(stale):
            os.remove(stale)
    onnx.save(model, dst, save_as_external_data=True, all_tensors_to_one_file=True,
              location=os.path.basename(dst) + ".data", size_threshold=1024)
    give_normal_mode(dst, dst + ".data")  # onnx's external-data writer creates it 0o600
    onnx.checker.check_model(dst, full_check=False)
    return stats
