"""EAGLE heads on ONNX Runtime: `edgespec export --to onnx` writes each head's draft step as a graph that agrees
with the numpy drafter (max |diff| <= 1e-4, ExportError otherwise), records it in the drafter entries (eagle and
eagle2 share one graph), and sessions on the onnx backend draft through it with greedy output equal to plain
decoding, chains and dynamic trees, keeping no numpy copy of what the graph holds. A target graph without the taps a head reads is refused at session creation.

One export of the tiny bundle (target, draft model, two head graphs) serves the module."""
import shutil

import numpy as np
import pytest

from export.drafters import eagle_onnx
from export.onnx.bundle import add_onnx_to_bundle
from runtime.model import bundle as bundle_io
from runtime.backends.factory import load_weights
from runtime.backends.onnx_net import OnnxNet
from runtime.errors import BundleError, ExportError
from runtime.serving.session import GenerationParams, Session
from tests.runtime.serving.test_eagle_session import PROMPT, eagle_bundle  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def onnx_bundle(eagle_bundle, tmp_path_factory):  # noqa: F811
    root = str(tmp_path_factory.mktemp("eagle_onnx") / "bundle")
    shutil.copytree(eagle_bundle, root)
    add_onnx_to_bundle(root, "fp32", ["final_norm"], validate=True)  # no EAGLE-3 taps in the target graph
    return root


def _run(root, drafter, backend, net_from=None):
    s = Session.open(root, drafter=drafter, backend=backend, max_context=256)
    try:
        if net_from is not None:  # the head's graph under a numpy target (whose taps include EAGLE-3's)
            s.drafter.net = OnnxNet(bundle_io.load(root).path(net_from))
        kind = type(s.drafter.net).__name__ if s.drafter is not None else None
        r = s.generate(PROMPT, GenerationParams(max_tokens=24))
        return r.token_ids, r.stats.tau, kind
    finally:
        s.close()


def test_export_records_one_graph_per_head_and_it_agrees_with_numpy(onnx_bundle):
    b = bundle_io.load(onnx_bundle)
    graphs = {n: b.drafters[n].backends["onnx"].files[0] for n in ("eagle", "eagle2", "eagle3")}
    assert graphs["eagle"] == graphs["eagle2"] == "onnx/drafter.eagle.fp32.onnx"  # same weights, one graph
    assert graphs["eagle3"] == "onnx/drafter.eagle3.fp32.onnx"
    heads = eagle_onnx.bundle_heads(b, load_weights(b, b.target_files("numpy_ref").files))
    for name, (drafter, _) in heads.items():
        assert eagle_onnx.compare_with_numpy(drafter, b.path(graphs[name])) <= eagle_onnx.TOLERANCE, name


def test_a_graph_that_disagrees_with_numpy_is_an_export_error(onnx_bundle, monkeypatch):
    b = bundle_io.load(onnx_bundle)
    drafter, _ = eagle_onnx.bundle_heads(b, load_weights(b, b.target_files("numpy_ref").files))["eagle3"]
    graph = b.path("onnx/drafter.eagle3.fp32.onnx")
    drafter.w["norm.weight"] = drafter.w["norm.weight"] * np.float32(1.01)  # numpy now differs from the graph
    monkeypatch.setattr(eagle_onnx, "export_eagle_onnx", lambda d, path: path)  # keep the graph as exported
    with pytest.raises(ExportError, match=r"drafter\.eagle3.*differs from the numpy drafter by .*> 1e-04"):
        eagle_onnx.export_and_check(drafter, graph, graph)


def test_greedy_onnx_sessions_draft_through_the_head_graphs_and_equal_plain_decoding(onnx_bundle):
    want, _, _ = _run(onnx_bundle, "none", "numpy_ref")
    for name in ("eagle", "eagle2"):  # chain, dynamic tree: target and head both on ONNX Runtime
        ids, tau, kind = _run(onnx_bundle, name, "onnx")
        assert (ids, kind) == (want, "OnnxNet"), name
        assert tau == _run(onnx_bundle, name, "numpy_ref")[1], name  # the graph drafts what numpy drafts
    ids, tau, kind = _run(onnx_bundle, "eagle3", "numpy_ref", net_from="onnx/drafter.eagle3.fp32.onnx")
    assert (ids, kind) == (want, "OnnxNet")
    assert tau == _run(onnx_bundle, "eagle3", "numpy_ref")[1]


def test_onnx_target_without_the_eagle3_taps_is_refused_at_session_creation(onnx_bundle):
    with pytest.raises(BundleError, match=r"layer_in\.0.*--taps final_norm layer_in\.0 layer_in\.1 layer_in\.2"):
        Session.open(onnx_bundle, drafter="eagle3", backend="onnx", max_context=256)


def test_a_head_on_its_graph_keeps_no_numpy_copy_of_the_weights_the_graph_holds(onnx_bundle):
    from runtime.drafters.eagle import EagleDrafter
    from runtime.model.layers import causal_mask

    s = Session.open(onnx_bundle, drafter="eagle2", backend="onnx", max_context=256)
    try:  # EAGLE-1: fc, layer and head all live in the graph (its drafting is checked above)
        assert type(s.drafter.net).__name__ == "OnnxNet" and s.drafter.w == {}
        assert s.drafter.memory_bytes == s.drafter.net.weight_bytes > 0  # counted once, where they live
    finally:
        s.close()
    s = Session.open(onnx_bundle, drafter="eagle3", backend="numpy_ref", max_context=256)
    try:  # EAGLE-3 keeps only its fc, which fuses the target taps outside the graph
        b, d = bundle_io.load(onnx_bundle), s.drafter
        on_graph = EagleDrafter(d.kind, d.spec, load_weights(b, b.drafters["eagle3"].files), d.embed, d.embed, d.cache,
                                b.drafters["eagle3"].params, net=OnnxNet(b.path("onnx/drafter.eagle3.fp32.onnx")))
        assert sorted(on_graph.w) == ["fc.weight"] and on_graph.head is None
        assert on_graph.memory_bytes == on_graph.w["fc.weight"].nbytes + on_graph.net.weight_bytes
        feats = np.random.default_rng(0).standard_normal((5, d.spec.hidden_size)).astype(np.float32)
        outs = []
        for drafter in (d, on_graph):
            d.cache.reset()
            outs.append(drafter._step(feats, [3, 9, 4, 7, 1], np.arange(5), causal_mask(0, 5)))
        assert max(np.abs(a - b_).max() for a, b_ in zip(*outs)) < 1e-4  # hidden and target-vocabulary logits
    finally:
        s.close()


def test_the_export_check_scales_its_tolerance_by_the_output_so_a_trained_heads_peaked_logits_pass():
    logits = np.array([50.0, -3.0], np.float32)  # a trained head: float32 rounding of ~2e-3 at |logit| 50
    assert eagle_onnx._scaled_error(logits + np.float32(2e-3), logits) <= eagle_onnx.TOLERANCE
    unit = np.array([0.5, -0.25], np.float32)  # unit scale: the same error is absolute, and too big
    assert eagle_onnx._scaled_error(unit + np.float32(2e-3), unit) > eagle_onnx.TOLERANCE


def test_a_catch_up_asks_the_graph_for_its_last_rows_logits_alone(onnx_bundle):
    """A catch-up (a new prompt, a probe after plain steps) runs T rows and reads the last row's logits: the graph
    computes only the rows `logit_rows` names, and they equal numpy's."""
    from runtime.model.layers import causal_mask

    b = bundle_io.load(onnx_bundle)
    drafter, _ = eagle_onnx.bundle_heads(b, load_weights(b, b.target_files("numpy_ref").files))["eagle3"]
    net = OnnxNet(b.path("onnx/drafter.eagle3.fp32.onnx"))
    assert "logit_rows" in net.input_names
    feats = np.random.default_rng(1).standard_normal((6, drafter.spec.hidden_size)).astype(np.float32)
    tokens, kv = [3, 9, 4, 7, 1, 5], np.zeros((0, drafter.spec.num_kv_heads, drafter.spec.head_dim), np.float32)
    feeds = {"input_ids": np.array(tokens), "features": feats, "position_ids": np.arange(6),
             "attention_mask": np.zeros((6, 6), np.float32), "past_key": kv, "past_value": kv}
    assert net.run({**feeds, "logit_rows": np.array([5])})["logits"].shape == (1, drafter.head.shape[0])
    got = []
    for runner in (None, net):  # numpy, then the graph: the same last row over the target's vocabulary
        drafter.cache.reset()
        drafter.net = runner
        got.append(drafter._step(feats, tokens, np.arange(6), causal_mask(0, 6), last_only=True)[1])
    assert got[1].shape == (1, drafter.vocab) and np.abs(got[0] - got[1]).max() < 1e-4
