"""`edgespec export --to onnx --attention gqa`: attention as ONNX Runtime's contrib op GroupQueryAttention over one
shared past/present K/V buffer per layer (head-major view of the arena). The graph matches the numpy reference
through prefill, decode, a tree verify (the tree mask as the op's attention_bias), keep and rollback; the op writes
only the new rows, in place; the bundle records the choice. Tree greedy identity and the device-arena path, shared
with the fused graph: test_contrib_op_graphs.py."""
import numpy as np
import pytest

from export.onnx.graph import export_target_onnx
from runtime.backends.onnx import OnnxTarget
from tests.support.hf_tiny import rel_err, tiny_hf_model
from tests.runtime.backends.test_onnx_backend import TOL, arena_cache, assert_same, pair, tree_inputs

ort = pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")


def _gqa_takes_attention_bias() -> bool:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    return any(s.name == "GroupQueryAttention" and s.domain == "com.microsoft"
               and any(i.name == "attention_bias" for i in s.inputs) for s in C.get_all_operator_schema())


pytestmark = pytest.mark.skipif(not _gqa_takes_attention_bias(),
                                reason=f"onnxruntime {ort.__version__}: its GroupQueryAttention has no attention_bias "
                                       "input (tree masks); upgrade onnxruntime (checked with 1.32)")
TAPS = ("final_norm", "layer_out.1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """qwen3: q/k norms and 2 query heads per KV head; the rope variants are the matmul graph's (same code)."""
    _, spec, weights = tiny_hf_model("qwen3", seed=11)
    path = str(tmp_path_factory.mktemp("gqa") / "qwen3.gqa.onnx")
    export_target_onnx(spec, weights, path, taps=TAPS, attention="gqa")
    return spec, weights, path


def test_gqa_graph_uses_the_contrib_op_and_matches_numpy_through_prefill_decode_tree_keep_rollback(exported):
    import onnx

    spec, weights, path = exported
    ops = {(n.domain, n.op_type) for n in onnx.load(path, load_external_data=False).graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops
    ort_t, ref = pair(spec, weights, path, taps=TAPS)
    assert ort_t.shared_kv
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, 40)
    assert_same(ort_t.forward(prompt, np.arange(40), taps=TAPS), ref.forward(prompt, np.arange(40), taps=TAPS), TAPS)
    tok = rng.integers(0, spec.vocab_size, 1)
    assert_same(ort_t.forward(tok, np.array([40]), taps=TAPS), ref.forward(tok, np.array([40]), taps=TAPS), TAPS)
    p = ort_t.cache_len
    tokens, positions, mask = tree_inputs(spec, p, rng)
    assert_same(ort_t.forward(tokens, positions, mask, TAPS), ref.forward(tokens, positions, mask, TAPS), TAPS)
    for t in (ort_t, ref):
        t.keep(p, [p, p + 1, p + 3])  # accept r -> a -> c: row p+3 moves to p+2 (in every head's block)
    nxt = rng.integers(0, spec.vocab_size, 2)
    assert_same(ort_t.forward(nxt, np.array([p + 3, p + 4])), ref.forward(nxt, np.array([p + 3, p + 4])))
    for t in (ort_t, ref):
        t.keep(30, [])  # roll back into the prompt
    assert_same(ort_t.forward(tok, np.array([30])), ref.forward(tok, np.array([30])))


def test_the_op_writes_only_the_new_rows_in_place_in_the_head_major_arena(exported):
    spec, weights, path = exported
    ort_t, ref = pair(spec, weights, path, taps=())
    bound = {}
    ort_t._bind_kv_out = (lambda bind: lambda n, dt, shape, ptr: (bound.__setitem__(n, ptr), bind(n, dt, shape, ptr)))(
        ort_t._bind_kv_out)
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, 20)
    for t in (ort_t, ref):
        t.forward(prompt[:12], np.arange(12))
        t.forward(prompt[12:], np.arange(12, 20))
    block = spec.num_kv_heads * ort_t.cache.max_positions * spec.head_dim * 4
    for i in range(spec.num_layers):
        assert bound[f"present_key_{i}"] == ort_t.cache.k.ctypes.data + i * block  # the past's own block
        k, v = ort_t.layer_kv(i)
        assert np.shares_memory(k, ort_t.cache.k)
        assert rel_err(k, ref.cache.k[:20, i]) <= TOL and rel_err(v, ref.cache.v[:20, i]) <= TOL
        assert not ort_t.k[i, :, 20:].any() and not ort_t.v[i, :, 20:].any()  # nothing past the new rows


def test_export_refuses_gqa_attention_for_a_quantised_graph_and_leaves_the_bundle_unchanged(tiny_bundle, tmp_path):
    """int8 activations magnify the op's batched-vs-one-row rounding into greedy mismatches (README), so the
    combination is refused before anything is written."""
    import os
    import shutil

    from export.onnx.bundle import add_onnx_to_bundle
    from runtime.errors import ExportError

    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    before = sorted(os.listdir(root)), open(os.path.join(root, "bundle.yaml")).read()
    with pytest.raises(ExportError, match="--attention gqa with --precision int8.*--precision int8`"):
        add_onnx_to_bundle(root, "int8", attention="gqa")
    assert (sorted(os.listdir(root)), open(os.path.join(root, "bundle.yaml")).read()) == before


def test_export_cli_records_gqa_attention_and_the_head_major_layout_in_the_bundle(tiny_bundle, tmp_path, capsys):
    import shutil

    from runtime.model import bundle as bundle_mod
    from runtime.cli import main

    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    assert main(["export", "--to", "onnx", "--bundle", root, "--attention", "gqa", "--no-validate"]) == 0
    b = bundle_mod.load(root)
    entry = b.target_files("onnx")
    assert entry.params["attention"] == "gqa" and entry.params["kv_layout"] == "layer_head_major"
    graph = next(f for f in entry.files if f.endswith(".onnx"))
    target = OnnxTarget(b.target.spec, b.path(graph), arena_cache(b.target.spec))
    assert target.shared_kv
    from export.tensorrt.build import _models
    from runtime.errors import BundleError

    with pytest.raises(BundleError, match="GroupQueryAttention.*--precision fp16 --attention matmul`"):  # TensorRT parses no contrib op
        _models(b)
