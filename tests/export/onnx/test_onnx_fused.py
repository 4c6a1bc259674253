"""`edgespec export --to onnx` (attention "fused", the default for a float target): the decoder written node by node
with ONNX Runtime's fused contrib ops (export/onnx/fused.py). For every model family it equals the numpy reference
through prefill, decode, a tree verify, keep and rollback (fp32 and fp16); its nodes are the lean set
(no RMSNorm or rope spelled out in elementwise ops); a KV cache longer than its rope table is refused; the bundle
export picks it for float targets only. Tree greedy identity and the device-arena path: test_contrib_op_graphs.py."""
import os
import shutil

import numpy as np
import pytest

from export.onnx.fused import export_fused_onnx, rope_positions
from runtime.backends.onnx import OnnxTarget
from runtime.errors import BackendError, ExportError
from tests.runtime.backends.test_onnx_backend import (FAMILIES, FP16_TOL, TOL, arena_cache, assert_same, greedy_decode,
                                                      pair, tree_inputs)
from tests.support.hf_tiny import tiny_hf_model

ort = pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")
TAPS = ("final_norm", "layer_in.0", "layer_in.2", "layer_out.1", "layer_out.2")


@pytest.fixture(scope="module", params=FAMILIES)
def fused(request, tmp_path_factory):
    """(spec, weights, fused fp32 graph) per family: llama, llama3 / linear rope scaling, qwen2 (qkv bias), qwen3
    (q/k norms)."""
    _, spec, weights = tiny_hf_model(request.param, seed=11)
    path = str(tmp_path_factory.mktemp("fused") / f"{request.param}.fused.onnx")
    export_fused_onnx(spec, weights, path, taps=TAPS)
    return spec, weights, path


def _through_prefill_decode_tree_keep_rollback(ort_t, ref, spec, tol):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, 40)
    taps = ort_t.tap_names
    assert_same(ort_t.forward(prompt, np.arange(40), taps=taps), ref.forward(prompt, np.arange(40), taps=taps), taps,
                tol)
    tok = rng.integers(0, spec.vocab_size, 1)
    assert_same(ort_t.forward(tok, np.array([40])), ref.forward(tok, np.array([40])), (), tol)
    p = ort_t.cache_len
    tokens, positions, mask = tree_inputs(spec, p, rng)
    assert_same(ort_t.forward(tokens, positions, mask, taps), ref.forward(tokens, positions, mask, taps), taps, tol)
    for t in (ort_t, ref):
        t.keep(p, [p, p + 1, p + 3])  # accept r -> a -> c: row p+3 moves to p+2 in every head's block
    nxt = rng.integers(0, spec.vocab_size, 2)
    assert_same(ort_t.forward(nxt, np.array([p + 3, p + 4])), ref.forward(nxt, np.array([p + 3, p + 4])), (), tol)
    for t in (ort_t, ref):
        t.keep(30, [])  # roll back into the prompt
    assert_same(ort_t.forward(tok, np.array([30])), ref.forward(tok, np.array([30])), (), tol)


def test_fused_graph_matches_numpy_through_prefill_decode_tree_keep_rollback(fused):
    spec, weights, path = fused
    ort_t, ref = pair(spec, weights, path, taps=TAPS)
    assert ort_t.shared_kv
    _through_prefill_decode_tree_keep_rollback(ort_t, ref, spec, TOL)


def test_fused_graph_is_the_lean_contrib_op_graph(fused):
    """Per layer: two (Skip)SimplifiedLayerNormalization, one packed qkv MatMul, one GroupQueryAttention doing the
    rope, o / gate / up / down MatMuls; none of the Pow / ReduceMean / Softmax / Neg / Concat a traced graph spells
    RMSNorm, rope and attention with."""
    import onnx

    spec, _, path = fused
    ops = [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]
    layers = spec.num_layers
    assert ops.count("GroupQueryAttention") == layers
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers  # the first layer's input norm has no skip
    assert ops.count("MatMul") == 5 * layers + 1  # qkv, o, gate, up, down per layer + the LM head
    assert not {"Pow", "ReduceMean", "Softmax", "Neg", "Concat", "Sin", "Cos"} & set(ops)


def test_the_fused_graphs_norms_compute_no_training_outputs(fused):
    """SkipSimplifiedLayerNormalization computes its optional mean / inverse-std outputs (1, 2) whenever they are
    named, bound or not: the graph leaves them unnamed and asks only for the normalised sum and the residual."""
    import onnx

    _, _, path = fused
    skips = [n for n in onnx.load(path, load_external_data=False).graph.node
             if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert skips and all(n.output[1] == n.output[2] == "" and n.output[0] and n.output[3] for n in skips)


def test_the_fused_graphs_taps_are_its_layers_own_tensors_with_no_node_run_for_them(fused, tmp_path):
    """ONNX Runtime runs every node of a graph, bound output or not, so a node per tap would run on every plain
    step: the graph with taps has the nodes of the graph without, plus one Identity where two taps name the same
    tensor (layer_in.2 is layer_out.1); the taps' values are the reference's (test above)."""
    import onnx

    spec, weights, path = fused
    bare = str(tmp_path / "bare.onnx")
    export_fused_onnx(spec, weights, bare, taps=())
    ops = lambda p: sorted(n.op_type for n in onnx.load(p, load_external_data=False).graph.node)
    with_taps = ops(path)
    with_taps.remove("Identity")  # the one alias: layer_out.1 of layer_in.2's tensor
    assert with_taps == ops(bare)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp16_fused_graph_matches_numpy_within_the_fp16_tolerance(family, tmp_path):
    _, spec, weights = tiny_hf_model(family, seed=11)
    path = export_fused_onnx(spec, weights, str(tmp_path / "t.fp16.onnx"), taps=("final_norm", "layer_out.1"),
                             precision="fp16")
    ort_t, ref = pair(spec, weights, path, dtype=np.float16, taps=("final_norm", "layer_out.1"))
    _through_prefill_decode_tree_keep_rollback(ort_t, ref, spec, FP16_TOL)


def test_a_kv_cache_longer_than_the_fused_graphs_rope_table_is_refused_at_load(tmp_path):
    """The op reads cos/sin rows by position without a bounds check of its own, so the backend checks once."""
    _, spec, weights = tiny_hf_model("llama", seed=1, num_layers=1)
    path = export_fused_onnx(spec, weights, str(tmp_path / "t.onnx"))
    rows = rope_positions(spec)
    OnnxTarget(spec, path, arena_cache(spec, positions=rows))
    with pytest.raises(BackendError, match=f"rope table holds {rows} positions.*max_context to {rows}"):
        OnnxTarget(spec, path, arena_cache(spec, positions=rows + 1))


def test_bundle_export_fuses_float_targets_only_and_records_it(tiny_bundle, tmp_path):
    """auto: the fp32 target graph is fused (head-major arena layout); the draft model's, an int8 target's and an fp16
    one's (the GPU graph) stay matmul graphs; asking for a fused int8 graph is refused before anything is written."""
    from export.onnx.bundle import add_onnx_to_bundle
    from runtime.model import bundle as bundle_mod

    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    add_onnx_to_bundle(root, "fp32", validate=True)
    add_onnx_to_bundle(root, "int8", validate=False)
    b = bundle_mod.load(root)
    target = b.target.backends["onnx"].params
    assert (target["attention"], target["kv_layout"]) == ("fused", "layer_head_major")
    assert "attention" not in b.target.backends["onnx.int8"].params
    draft = b.drafters["draft_model"].backends["onnx"].params
    assert ("attention" not in draft, draft["kv_layout"]) == (True, "layer_major")
    before = sorted(os.listdir(os.path.join(root, "onnx"))), open(os.path.join(root, "bundle.yaml")).read()
    with pytest.raises(ExportError, match="--attention fused with --precision int8"):
        add_onnx_to_bundle(root, "int8", attention="fused")
    assert (sorted(os.listdir(os.path.join(root, "onnx"))), open(os.path.join(root, "bundle.yaml")).read()) == before
    add_onnx_to_bundle(root, "fp16", validate=False)
    assert "attention" not in bundle_mod.load(root).target.backends["onnx"].params


def test_the_kv_blocks_are_bound_once_and_again_only_when_the_bound_taps_change(fused):
    """The shared past/present blocks never move, so a decode step binds only ids, positions, mask and outputs;
    the results through the tap changes are the numpy reference's (test above)."""
    spec, weights, path = fused
    ort_t, ref = pair(spec, weights, path, taps=TAPS)
    calls = []
    bind = ort_t._bind_kv_in
    ort_t._bind_kv_in = lambda *a: (calls.append(a[0]), bind(*a))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, spec.vocab_size, 8)
    for t in (ort_t, ref):
        t.forward(prompt, np.arange(8))
    for pos in range(8, 13):
        tok = rng.integers(0, spec.vocab_size, 1)
        assert_same(ort_t.forward(tok, np.array([pos])), ref.forward(tok, np.array([pos])))
    assert len(calls) == 2 * spec.num_layers  # past_key_i, past_value_i: once for the 6 forwards
    tok = rng.integers(0, spec.vocab_size, 1)
    assert_same(ort_t.forward(tok, np.array([13]), taps=TAPS[:1]), ref.forward(tok, np.array([13]), taps=TAPS[:1]),
                TAPS[:1])
    assert len(calls) == 4 * spec.num_layers  # the outputs changed: bound again


def test_a_plain_step_binds_only_its_mask_and_logits_and_writes_ids_and_positions_in_place(fused):
    """Host work per step: ids, positions and logits_from live in buffers bound once per T; a step of the same T
    writes two numbers and binds only the attention mask (its shape grows) and the logits it returns. A change of
    T (a verify, a prefill chunk) binds them again; every forward's logits are the reference's."""
    spec, weights, path = fused
    ort_t, ref = pair(spec, weights, path, taps=TAPS)
    names = []
    bind = ort_t._bind_input
    ort_t._bind_input = lambda n, *a: (names.append(n), bind(n, *a))
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, spec.vocab_size, 10)
    assert_same(ort_t.forward(prompt, np.arange(10)), ref.forward(prompt, np.arange(10)))
    steps = [(rng.integers(0, spec.vocab_size, 1), np.array([pos])) for pos in range(10, 14)]
    steps.insert(2, (rng.integers(0, spec.vocab_size, 3), np.arange(12, 15)))  # a 2-node chain verify in between
    steps[3:] = [(tok, pos + 3) for tok, pos in steps[3:]]
    for tok, pos in steps:
        names.clear()
        assert_same(ort_t.forward(tok, pos), ref.forward(tok, pos))
        first_of_its_t = len(tok) == 3 or pos[0] in (10, 15)
        assert sorted(names) == (["attention_mask", "input_ids", "logits_from", "position_ids"] if first_of_its_t
                                 else ["attention_mask"])


def test_a_prefill_fetches_only_its_last_logits_row_from_the_fused_graph(fused):
    """The engine's prefill samples from the last row only: the graph's head runs on that row and the backend
    binds a (1, V) logits buffer, not (T, V); its values are the full forward's last row."""
    from runtime.backends.base import forward_in_chunks

    spec, weights, path = fused
    ort_t, ref = pair(spec, weights, path, taps=TAPS)
    shapes = []
    bind = ort_t._bind_output
    ort_t._bind_output = lambda n, dt, shape, ptr: (shapes.append((n, tuple(shape))), bind(n, dt, shape, ptr))
    prompt = np.random.default_rng(6).integers(0, spec.vocab_size, 30)
    got = forward_in_chunks(ort_t, prompt, np.arange(30), TAPS[:1], chunk=12, all_logits=False)
    want = ref.forward(prompt, np.arange(30), taps=TAPS[:1])
    assert [s for n, s in shapes if n == "logits"] == [(1, spec.vocab_size)] * 3  # chunks of 12, 12 and 6 tokens
    assert got.logits.shape == (1, spec.vocab_size) and got.taps["final_norm"].shape == (30, spec.hidden_size)
    assert_same(got, type(want)(want.logits[-1:], want.taps), TAPS[:1])
    tok = prompt[:2]  # and the next forward's logits are every row again
    assert ort_t.forward(tok, np.array([30, 31])).logits.shape == (2, spec.vocab_size)


def test_the_engine_prefill_asks_every_backend_for_its_last_logits_row_only():
    """numpy_ref honours it too (its head runs on the last row); the engine's first token is unchanged."""
    from runtime.backends.numpy_ref import NumpyTarget
    from runtime.decode.engine import Engine
    from runtime.sampling import SamplingParams

    _, spec, weights = tiny_hf_model("llama", seed=2)
    target = NumpyTarget(spec, weights, arena_cache(spec))
    rows = []
    forward = target.forward
    target.forward = lambda *a, **k: (lambda r: (rows.append(r.logits.shape[0]), r)[1])(forward(*a, **k))
    prompt = list(np.random.default_rng(7).integers(0, spec.vocab_size, 20))
    out = Engine(target, None, prefix_cache=False).generate(prompt, SamplingParams(), 4)
    assert rows == [1, 1, 1, 1]  # the prefill's last row, then one row per plain step
    assert out.tokens == greedy_decode(NumpyTarget(spec, weights, arena_cache(spec)), np.array(prompt), 4)


def test_causal_steps_on_the_fused_graph_bind_one_kept_zero_bias(fused):
    """The op masks the future itself (causal=1), so a causal forward (mask None: a prefill, a plain step, a
    chain) binds a view of one zero buffer instead of building a (T, P+T) mask; the logits stay the reference's."""
    spec, weights, path = fused
    ort_t, ref = pair(spec, weights, path, taps=())
    bound = []
    bind = ort_t._bind_input
    ort_t._bind_input = lambda n, dt, shape, ptr: (n == "attention_mask" and bound.append(ptr), bind(n, dt, shape, ptr))
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, spec.vocab_size, 24)
    assert_same(ort_t.forward(prompt, np.arange(24)), ref.forward(prompt, np.arange(24)))
    for pos in range(24, 28):
        toks = rng.integers(0, spec.vocab_size, 2)
        pos_pair = np.array([2 * pos - 24, 2 * pos - 23])
        assert_same(ort_t.forward(toks, pos_pair), ref.forward(toks, pos_pair))  # a 1-node chain with its root
    assert len(set(bound)) == 1


def test_a_fused_graph_on_a_cuda_provider_is_refused_at_load_with_the_export_that_fits(fused, monkeypatch):
    """ONNX Runtime's CUDA GroupQueryAttention refuses an attention_bias (the tree mask), so a fused (or gqa) graph
    would fail on its first forward there: the backend says so at load (the session is a CPU one here)."""
    import runtime.backends.onnx as onnx_backend

    spec, _, path = fused
    real = onnx_backend.open_session
    monkeypatch.setattr(onnx_backend, "open_session", lambda p, providers, *a: real(p, ("CPUExecutionProvider",), *a))
    with pytest.raises(BackendError, match="CUDA kernel refuses.*--attention matmul`"):
        OnnxTarget(spec, path, arena_cache(spec), providers=("CUDAExecutionProvider",))
