"""Chunked prefill (runtime/backends/base.forward_in_chunks, the one place every backend's prefill goes through):
a prompt several chunks long, run as consecutive causal forwards, gives the logits, the taps (rows concatenated)
and the K/V rows of one forward within the backend's precision, on the numpy reference and on ONNX Runtime
(the llama.cpp case is in test_gguf.py, beside its GGUF fixture)."""
import numpy as np
import pytest

from runtime.backends.base import forward_in_chunks
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.memory.kv import KVArena
from tests.support.hf_tiny import rel_err, tiny_hf_model

TAPS = ("final_norm", "layer_in.0", "layer_in.2", "layer_out.1")
PROMPT, CHUNK = 100, 16  # 7 chunks, the last one short (4 tokens)


def two_caches(spec, positions=128, dtype=np.float32):
    shape = cache_shape(spec)
    arena = KVArena.for_context({"one": shape, "chunked": shape}, positions, dtype)
    return arena.allocate("one", shape, positions), arena.allocate("chunked", shape, positions)


@pytest.fixture(scope="module")
def model():
    _, spec, weights = tiny_hf_model("qwen3", seed=5)
    return spec, weights


def assert_chunked_equals_one_forward(one, chunked, tol):
    prompt = np.random.default_rng(0).integers(0, one.spec.vocab_size, PROMPT)
    ref = one.forward(prompt, np.arange(PROMPT), None, TAPS)
    got = forward_in_chunks(chunked, prompt, np.arange(PROMPT), TAPS, CHUNK)
    assert got.logits.shape == ref.logits.shape and chunked.cache_len == one.cache_len == PROMPT
    assert rel_err(got.logits, ref.logits) <= tol
    for t in TAPS:
        assert got.taps[t].shape == ref.taps[t].shape and rel_err(got.taps[t], ref.taps[t]) <= tol, t
    return prompt, ref


def test_numpy_prefill_in_chunks_gives_one_forwards_logits_taps_and_kv(model):
    spec, weights = model
    a, b = two_caches(spec)
    one, chunked = NumpyTarget(spec, weights, a), NumpyTarget(spec, weights, b)
    assert_chunked_equals_one_forward(one, chunked, 1e-5)
    np.testing.assert_allclose(b.k[:PROMPT], a.k[:PROMPT], atol=1e-5)
    np.testing.assert_allclose(b.v[:PROMPT], a.v[:PROMPT], atol=1e-5)


def test_a_prefill_keeping_only_the_last_logits_row_holds_one_row_and_every_tap_row(model):
    spec, weights = model
    a, b = two_caches(spec)
    one, chunked = NumpyTarget(spec, weights, a), NumpyTarget(spec, weights, b)
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, PROMPT)
    ref = one.forward(prompt, np.arange(PROMPT), None, TAPS)
    last = forward_in_chunks(chunked, prompt, np.arange(PROMPT), TAPS, CHUNK, all_logits=False)
    assert last.logits.shape == (1, spec.vocab_size)
    assert rel_err(last.logits[0], ref.logits[-1]) <= 1e-5
    assert all(last.taps[t].shape == (PROMPT, spec.hidden_size) for t in TAPS)


def test_no_forward_of_a_chunked_prefill_is_longer_than_the_chunk(model):
    spec, weights = model
    target = NumpyTarget(spec, weights, two_caches(spec)[0])
    sizes = []
    real = target.forward
    target.forward = lambda tokens, *rest: sizes.append(len(tokens)) or real(tokens, *rest)
    forward_in_chunks(target, np.zeros(PROMPT, np.int64), np.arange(PROMPT), (), CHUNK, all_logits=False)
    assert sizes == [16] * 6 + [4]


def test_onnx_prefill_in_chunks_gives_one_forwards_logits_and_taps(model, tmp_path):
    pytest.importorskip("onnxruntime")
    from export.onnx.graph import export_target_onnx
    from runtime.backends.onnx import OnnxTarget

    spec, weights = model
    path = str(tmp_path / "qwen3.onnx")
    export_target_onnx(spec, weights, path, taps=TAPS)
    a, b = two_caches(spec)
    one, chunked = (OnnxTarget(spec, path, c, tap_names=TAPS) for c in (a, b))
    assert_chunked_equals_one_forward(one, chunked, 1e-4)
    for layer in range(spec.num_layers):
        for x, y in zip(chunked.layer_kv(layer), one.layer_kv(layer)):
            np.testing.assert_allclose(x, y, atol=1e-4)
    # and against the oracle: the chunked ONNX prefill is the numpy reference's one forward
    oracle = NumpyTarget(spec, weights, two_caches(spec)[0])
    prompt = np.random.default_rng(0).integers(0, spec.vocab_size, PROMPT)
    chunked.reset()
    got = forward_in_chunks(chunked, prompt, np.arange(PROMPT), TAPS, CHUNK)
    assert rel_err(got.logits, oracle.forward(prompt, np.arange(PROMPT), None, TAPS).logits) <= 1e-4


def test_a_tap_named_twice_comes_out_once_with_one_row_per_prompt_token(model):
    """EAGLE-3 on a shallow target names one layer twice (taps [2, 2, 1] of 4 layers): the prefill gives that tap
    one (T, H) array, as one forward does, not its rows twice."""
    spec, weights = model
    _, b = two_caches(spec)
    prompt = np.random.default_rng(2).integers(0, spec.vocab_size, PROMPT)
    got = forward_in_chunks(NumpyTarget(spec, weights, b), prompt, np.arange(PROMPT),
                            ("layer_in.2", "layer_in.2", "layer_in.0"), CHUNK, all_logits=False)
    assert sorted(got.taps) == ["layer_in.0", "layer_in.2"]
    assert all(v.shape == (PROMPT, spec.hidden_size) for v in got.taps.values())
