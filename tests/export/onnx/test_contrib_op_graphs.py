"""What every graph built on ONNX Runtime's contrib ops must keep, checked on each: the GroupQueryAttention graph
(`--attention gqa`, export/onnx/graph.py) and the fused graph (`--attention fused`, export/onnx/fused.py, every
model family). Tree greedy decoding on it emits exactly the token-by-token greedy tokens, and the device-arena
(OrtValue) path gives the host path's logits and K/V bitwise."""
import numpy as np
import pytest

from tests.runtime.backends.test_onnx_backend import FAMILIES, arena_cache, assert_tree_greedy_identity, tree_inputs
from tests.support.hf_tiny import tiny_hf_model

ort = pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")
from runtime.backends.onnx import OnnxTarget  # noqa: E402 (needs onnxruntime)

GRAPHS = [("gqa", "qwen3")] + [("fused", family) for family in FAMILIES]


@pytest.fixture(scope="module", params=GRAPHS, ids=[f"{a}-{f}" for a, f in GRAPHS])
def graph(request, tmp_path_factory):
    """(spec, graph path) of one attention kind on one tiny model family."""
    from tests.export.onnx.test_onnx_gqa import _gqa_takes_attention_bias

    attention, family = request.param
    if attention == "gqa" and not _gqa_takes_attention_bias():
        pytest.skip(f"onnxruntime {ort.__version__}: its GroupQueryAttention has no attention_bias input (tree masks)")
    _, spec, weights = tiny_hf_model(family, seed=11)
    path = str(tmp_path_factory.mktemp(attention) / f"{family}.{attention}.onnx")
    if attention == "fused":
        from export.onnx.fused import export_fused_onnx

        export_fused_onnx(spec, weights, path, taps=("final_norm", "layer_in.0", "layer_out.1"))
    else:
        from export.onnx.graph import export_target_onnx

        export_target_onnx(spec, weights, path, taps=("final_norm", "layer_out.1"), attention="gqa")
    return spec, path


def test_tree_verification_on_the_graph_emits_the_token_by_token_greedy_tokens(graph):
    """20 random prompts, 12 tokens each, a 6-node tree per step: exact token identity (fp32)."""
    spec, path = graph
    assert_tree_greedy_identity(OnnxTarget(spec, path, arena_cache(spec)), spec, 20)


def test_device_arena_path_gives_the_host_logits_and_kv_bitwise(graph):
    spec, path = graph
    host = OnnxTarget(spec, path, arena_cache(spec))
    dev = OnnxTarget(spec, path, arena_cache(spec), arena_device="cpu")
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, spec.vocab_size, 16)
    tokens, positions, mask = tree_inputs(spec, 16, rng)
    for t in (host, dev):
        t.forward(prompt, np.arange(16))
        t.forward(tokens, positions, mask)
        t.keep(16, [16, 17, 19])
    np.testing.assert_array_equal(host.forward(prompt[:1], np.array([19])).logits,
                                  dev.forward(prompt[:1], np.array([19])).logits)
    for i in range(spec.num_layers):
        for a, b in zip(host.layer_kv(i), dev.layer_kv(i)):
            np.testing.assert_array_equal(a, b)
