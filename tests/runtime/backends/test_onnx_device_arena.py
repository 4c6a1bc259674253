"""The KV arena as an ONNX Runtime OrtValue (what the CUDA / TensorRT providers get) runs the same code on
the CPU provider here: the graph's past/new K/V bound by the OrtValue's address, rows compacted after a tree
verify by the Gather graph on the device. It gives bitwise the logits of the host-arena path, and tree
greedy decoding on it equals token-by-token decoding. The CUDA run itself needs onnxruntime-gpu and a GPU."""
import doctest

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from export.onnx.graph import export_target_onnx
from runtime.backends import onnx_arena
from runtime.commands import gpu_identity
from runtime.backends.onnx import OnnxTarget
from tests.support.hf_tiny import tiny_hf_model
from tests.runtime.backends.test_onnx_backend import arena_cache, greedy_decode, greedy_tree_decode, tree_inputs

ort = pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    _, spec, weights = tiny_hf_model("llama", seed=21)
    path = str(tmp_path_factory.mktemp("device") / "llama.onnx")
    export_target_onnx(spec, weights, path, taps=("final_norm",))
    return spec, weights, path


def test_the_embedded_kv_rows_graph_is_what_onnx_helper_builds():
    for np_dtype, onnx_dtype in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
        io = lambda name, dims, dt=onnx_dtype: helper.make_tensor_value_info(name, dt, dims)  # noqa: E731
        graph = helper.make_graph(
            [helper.make_node("Gather", ["k", "idx"], ["k_rows"], axis=1),
             helper.make_node("Gather", ["v", "idx"], ["v_rows"], axis=1)], "kv_rows",
            [io("k", ["A", "S", "W"]), io("v", ["A", "S", "W"]), io("idx", ["N"], TensorProto.INT64)],
            [io("k_rows", ["A", "N", "W"]), io("v_rows", ["A", "N", "W"])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="edgespec")
        model.ir_version = 8
        onnx.checker.check_model(model)
        assert model.SerializeToString() == onnx_arena.KV_ROWS_GRAPH[np.dtype(np_dtype)]


def test_address_arithmetic_and_provider_choice():
    assert doctest.testmod(onnx_arena).failed == 0
    assert onnx_arena.device_for(["CUDAExecutionProvider", "CPUExecutionProvider"]) == "cuda"
    assert onnx_arena.device_for([]) == "cpu"


def test_ortvalue_arena_gives_the_host_arena_logits_bitwise_through_decode_tree_and_keep(exported):
    spec, _, path = exported
    host = OnnxTarget(spec, path, arena_cache(spec))
    dev = OnnxTarget(spec, path, arena_cache(spec), arena_device="cpu")
    assert dev.device_arena is not None and host.device_arena is None
    assert not dev.cache.k.any(), "the host arena is not what the device path writes"
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, 20)
    for t in (host, dev):
        out = t.forward(prompt, np.arange(20))
    np.testing.assert_array_equal(host.forward(prompt[:1], np.array([20])).logits,
                                  dev.forward(prompt[:1], np.array([20])).logits)
    p = host.cache_len
    tokens, positions, mask = tree_inputs(spec, p, rng)
    np.testing.assert_array_equal(host.forward(tokens, positions, mask).logits, dev.forward(tokens, positions, mask).logits)
    for t in (host, dev):
        t.keep(p, [p, p + 1, p + 3])  # rows move on the device (p+3 -> p+2)
    for i in range(spec.num_layers):
        for a, b in zip(host.layer_kv(i), dev.layer_kv(i)):
            np.testing.assert_array_equal(a, b)
    nxt = rng.integers(0, spec.vocab_size, 2)
    np.testing.assert_array_equal(host.forward(nxt, np.array([p + 3, p + 4])).logits,
                                  dev.forward(nxt, np.array([p + 3, p + 4])).logits)
    assert out.logits.shape == (20, spec.vocab_size)


def test_tree_greedy_decoding_on_the_ortvalue_arena_equals_token_by_token_decoding(exported):
    spec, _, path = exported
    dev = OnnxTarget(spec, path, arena_cache(spec), arena_device="cpu")
    rng = np.random.default_rng(5)
    for _ in range(10):
        prompt = rng.integers(0, spec.vocab_size, int(rng.integers(2, 30)))
        plain = greedy_decode(dev, prompt, 12)
        assert greedy_tree_decode(dev, prompt, 12, plain, rng) == plain


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="no CUDAExecutionProvider in this onnxruntime: needs onnxruntime-gpu and an NVIDIA GPU "
                           "(scripts/gpu_check.sh runs it there)")
def test_cuda_arena_greedy_identity_on_the_zoo():
    report = gpu_identity.greedy_identity("build/bundles/zoo", ["CUDAExecutionProvider", "CPUExecutionProvider"],
                                        prompts=4, max_tokens=32)
    assert report["arena_device"] == "cuda" and report["identical"], report
