"""Weight-only int8 / int4 graphs for TensorRT (export/tensorrt/quantize.py), run here with ONNX Runtime on the same exported
fp16 graph TensorRT builds from: the projections become integer initializers behind DequantizeLinear, the embedding
and head stay fp16, the bytes shrink as the precision says, and the logits stay near the unquantized graph's
(int8 much nearer than int4); each quantizer is within half a step per weight, and a wrongly oriented scale, the
control, is far off."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.tensorrt.quantize import int4_tensor, quantize_graph, quantize_int4, quantize_int8
from runtime.backends.onnx import causal_additive_mask


@pytest.fixture(scope="module")
def fp16_graph(tiny_fp16_graph):
    return tiny_fp16_graph


def logits(path, spec, seed=0):
    rng = np.random.default_rng(seed)
    p, t = 6, 3
    feeds = {"input_ids": rng.integers(0, spec.vocab_size, t), "position_ids": np.arange(p, p + t),
             "attention_mask": causal_additive_mask(p, t)}
    for k in ("key", "value"):
        for i in range(spec.num_layers):
            feeds[f"past_{k}_{i}"] = rng.standard_normal((p, spec.num_kv_heads, spec.head_dim)).astype(np.float16)
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def test_int8_and_int4_graphs_run_and_stay_near_the_fp16_graph(fp16_graph, tmp_path):
    spec, src = fp16_graph
    base = logits(src, spec)
    err = {}
    for w in ("int8", "int4"):
        dst = str(tmp_path / f"{w}.onnx")
        stats = quantize_graph(src, dst, w)
        assert stats["quantized"] == 7 * spec.num_layers and stats["kept"] == 0  # q k v o gate up down
        assert stats["bytes_after"] < stats["bytes_before"] * (0.55 if w == "int8" else 0.35)
        model = onnx.load(dst, load_external_data=False)
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        assert len(dq) == 7 * spec.num_layers
        kinds = {t.data_type for t in model.graph.initializer if t.name.endswith("_q")}
        assert kinds == {onnx.TensorProto.INT8 if w == "int8" else onnx.TensorProto.INT4}
        assert any(t.data_type == onnx.TensorProto.FLOAT16 and t.dims[0] == spec.vocab_size
                   for t in model.graph.initializer)  # the embedding / tied head is left in fp16
        out = logits(dst, spec)
        err[w] = float(np.abs(out.astype(np.float32) - base).max() / np.abs(base).max())
    # Random weights (std 0.2) compound the rounding through the layers: int8 ~0.1 here, int4 ~1 (on the trained zoo
    # target: 0.013 and 0.17, README). What must hold: int8 stays near, and int4 costs several times more.
    assert err["int8"] < 0.15 and err["int8"] * 4 < err["int4"], err


def test_quantizers_round_trip_within_half_a_step_and_a_transposed_scale_does_not():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 24)).astype(np.float32) * np.linspace(0.1, 3, 24)  # columns of very different size
    q, s = quantize_int8(w)
    assert np.all(np.abs(q * s - w) <= s / 2 + 1e-7)
    q4, s4 = quantize_int4(w, 16)
    assert np.all(np.abs(q4.reshape(4, 16, 24) * s4[:, None, :] - w.reshape(4, 16, 24)) <= s4[:, None, :] / 2 + 1e-7)
    wrong = q * np.abs(w).max(axis=1, keepdims=True) / 127  # control: scales per row instead of per column
    assert np.abs(wrong - w).max() > 10 * np.abs(q * s - w).max()


def test_int4_values_are_packed_low_nibble_first_as_onnx_reads_them():
    q = np.array([[1, -2, 3], [-7, 7, 0]], np.int8)
    assert np.array_equal(onnx.numpy_helper.to_array(int4_tensor("q", q)).astype(np.int8), q)
