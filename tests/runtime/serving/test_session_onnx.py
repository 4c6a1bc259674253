"""A bundle exported for ONNX Runtime serves the same requests as on the numpy reference: the target and
the draft model run as ONNX graphs on one KV arena, and greedy speculative output equals plain decoding."""
import shutil

import pytest

from runtime.serving.session import GenerationParams, Session

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")


@pytest.fixture(scope="module")
def onnx_bundle(tiny_bundle, tmp_path_factory):
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("onnx") / "bundle")
    shutil.copytree(tiny_bundle, root)
    add_onnx_to_bundle(root, "fp32", None, validate=False)
    return root


PROMPTS = ["<|bos|><|plan|>pick up the red cup<|sep|>", "<|bos|><|text|>the robot opens the drawer and the drawer"]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "none"])
def test_onnx_session_greedy_output_equals_the_numpy_reference(onnx_bundle, drafter):
    ref = Session.open(onnx_bundle, drafter="none", backend="numpy_ref", max_context=256)
    onnx = Session.open(onnx_bundle, drafter=drafter, backend="onnx", max_context=256)
    assert onnx.target.name == "onnx"
    if drafter == "draft_model":
        assert onnx.drafter.model.name == "onnx"  # the draft model runs as its own graph too
    for prompt in PROMPTS:
        a = ref.generate(prompt, GenerationParams(max_tokens=20))
        b = onnx.generate(prompt, GenerationParams(max_tokens=20))
        assert a.token_ids == b.token_ids
        assert b.stats.backend == "onnx"


def test_sampled_speculative_decoding_on_onnx_passes_certify(onnx_bundle):
    """alpha = 0.001, 2000 draws, fixed seed: the exactness test of the verification issue on this backend."""
    from runtime.certify.run import certify
    from runtime.sampling import SamplingParams

    session = Session.open(onnx_bundle, drafter="draft_model", backend="onnx", max_context=128)
    (res,) = certify(session, PROMPTS[:1], SamplingParams(temperature=1.0), draws=2000, alpha=1e-3, seed=9)
    assert res.passed, res


def test_the_default_backend_is_onnx_where_onnxruntime_is_installed_and_the_bundle_has_graphs(onnx_bundle):
    """numpy_ref is the slow oracle: a plain request runs on ONNX Runtime unless the oracle is asked for."""
    assert Session.open(onnx_bundle, drafter="none", max_context=64).backend_name == "onnx"
    assert Session.open(onnx_bundle, drafter="none", backend="numpy_ref", max_context=64).backend_name == "numpy_ref"
