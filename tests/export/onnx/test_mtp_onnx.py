"""MTP modules on ONNX Runtime: `edgespec export --to onnx` writes one graph per module of a bundle's mtp drafter
(checked against the numpy module, refused when it differs), the session runs them when its backend is onnx,
and greedy speculative decoding with them stays token-identical to plain decoding on the same backend."""
import os

import pytest
import yaml

from runtime.model import bundle as bundle_mod
from runtime.errors import ExportError
from runtime.serving.session import GenerationParams, Session
from tests.support.mtp_tiny import write_mtp_checkpoint

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

PROMPT = "<|bos|><|text|>the robot opens the drawer and the drawer"


@pytest.fixture(scope="module")
def mtp_bundle(tmp_path_factory):
    """A 2-module MTP bundle (tiny random target) with its ONNX graphs, exported and validated."""
    from export.bundle.builder import build_bundle
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("mtp_onnx"))
    out = build_bundle(write_mtp_checkpoint(root, modules=2), os.path.join(root, "bundle"), name="mtp2")
    add_onnx_to_bundle(out, "fp32")
    return out


def test_export_writes_one_graph_per_module_that_matches_the_numpy_module(mtp_bundle):
    from export.drafters.mtp_onnx import validate_mtp_onnx
    from runtime.model.tensors import read_safetensors

    b = bundle_mod.load(mtp_bundle)
    entry = b.drafters["mtp"]
    assert entry.params["num_modules"] == 2
    graphs = [f for f in entry.backends["onnx"].files if f.endswith(".onnx")]
    assert graphs == ["onnx/drafter.mtp.fp32.onnx", "onnx/drafter.mtp.module1.fp32.onnx"]
    weights = read_safetensors(b.path(entry.files[0]))
    target = read_safetensors(b.path(b.target_files("numpy_ref").files[0]))
    for i, g in enumerate(graphs):
        args = (b.target.spec, weights, target, "deepseek_v3", i, b.target.spec.num_layers)
        assert validate_mtp_onnx(args, b.path(g), verbose=False) <= 1e-4


def test_a_graph_that_differs_from_the_numpy_module_fails_the_check(mtp_bundle):
    """Module 0's graph checked against module 1's weights (a graph that does not reproduce its module)."""
    from export.drafters.mtp_onnx import validate_mtp_onnx
    from export.onnx.graph import check_against_reference
    from runtime.model.tensors import read_safetensors

    b = bundle_mod.load(mtp_bundle)
    weights = read_safetensors(b.path(b.drafters["mtp"].files[0]))
    target = read_safetensors(b.path(b.target_files("numpy_ref").files[0]))
    args = (b.target.spec, weights, target, "deepseek_v3", 1, b.target.spec.num_layers)
    err = validate_mtp_onnx(args, b.path("onnx/drafter.mtp.fp32.onnx"), verbose=False)
    with pytest.raises(ExportError, match=r"module 0\): the exported fp32 graph differs from the numpy reference"):
        check_against_reference("drafter.mtp.fp32.onnx (drafter mtp, module 0)", err, "fp32")


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_greedy_mtp_on_onnx_is_token_identical_to_plain_decoding(mtp_bundle, num_tokens):
    plain = Session.open(mtp_bundle, drafter="none", backend="onnx").generate(PROMPT, GenerationParams(max_tokens=40))
    s = Session.open(mtp_bundle, drafter="mtp", backend="onnx", num_tokens=num_tokens)
    assert s.drafter.backend == "onnx" and len(s.drafter.modules) == 2
    got = s.generate(PROMPT, GenerationParams(max_tokens=40))
    assert got.token_ids == plain.token_ids
    assert got.stats.cycles < len(got.token_ids)  # drafts were accepted: the graphs' drafts were verified, not skipped


def test_the_numpy_backend_runs_the_modules_in_numpy_and_drafts_what_the_graphs_draft(mtp_bundle):
    from runtime.drafters.base import DraftContext
    from runtime.sampling import SamplingParams
    import numpy as np

    trees = []
    for backend in ("numpy_ref", "onnx"):
        s = Session.open(mtp_bundle, drafter="mtp", backend=backend, num_tokens=4)
        assert s.drafter.backend == ("onnx" if backend == "onnx" else "numpy")
        ids = s.tokenizer.encode(PROMPT)
        res = s.target.forward(np.array(ids), np.arange(len(ids)), taps=s.drafter.target_taps)
        s.drafter.begin(ids, res.taps)
        tree = s.drafter.propose(DraftContext(ids + [int(np.argmax(res.logits[-1]))], SamplingParams(temperature=1.0),
                                              np.random.default_rng(0), 8))
        trees.append(tree)
    assert np.allclose(trees[0].q, trees[1].q, rtol=1e-4, atol=1e-6)


def test_a_bundle_whose_onnx_entry_lacks_a_module_graph_is_refused_by_name(mtp_bundle, tmp_path):
    import shutil

    root = str(tmp_path / "b")
    shutil.copytree(mtp_bundle, root)
    path = os.path.join(root, "bundle.yaml")
    manifest = yaml.safe_load(open(path))
    manifest["drafters"]["mtp"]["backends"]["onnx"]["files"] = manifest["drafters"]["mtp"]["backends"]["onnx"]["files"][:2]
    yaml.safe_dump(manifest, open(path, "w"))
    with pytest.raises(Exception, match=r"lists 1 graphs for 2 modules; re-export"):
        Session.open(root, drafter="mtp", backend="onnx")


def test_the_prefix_cache_with_both_module_graphs_gives_the_same_tokens_and_drafts_as_a_full_prefill(mtp_bundle):
    from tests.runtime.decode.test_prefix_cache import _run

    params = GenerationParams(max_tokens=20)
    runs = {cache: _run(Session.open(mtp_bundle, drafter="mtp", backend="onnx", num_tokens=3, max_context=512,
                                     prefix_cache=cache), params) for cache in (False, True)}
    assert runs[True][0] == runs[False][0]
    assert [st.tau for st in runs[True][1]] == pytest.approx([st.tau for st in runs[False][1]])
    assert sum(st.prefix_tokens for st in runs[True][1]) > 0
