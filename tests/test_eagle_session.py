"""EAGLE heads added to a real bundle run in a Session: greedy output equals plain decoding on numpy_ref and on
ONNX Runtime; a backend graph that lacks the hidden taps a head reads is refused when the session is created,
with the command that fixes it."""
import shutil

import pytest

from export.drafters.eagle import add_eagle_to_bundle
from runtime import bundle as bundle_io
from runtime.errors import BundleError
from runtime.session import GenerationParams, Session
from tests.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint

PROMPT = "navigate to the kitchen and"


@pytest.fixture(scope="module")
def eagle_bundle(tiny_bundle, tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle_bundle")
    root = str(d / "bundle")
    shutil.copytree(tiny_bundle, root)
    spec = bundle_io.load(root).target.spec
    e1 = eagle1_checkpoint(str(d / "e1"), spec, seed=1)
    add_eagle_to_bundle(root, e1, name="eagle")
    add_eagle_to_bundle(root, e1, name="eagle2", tree={"total_tokens": 10, "depth": 4, "top_k": 3})
    add_eagle_to_bundle(root, eagle3_checkpoint(str(d / "e3"), spec, seed=2, draft_vocab=100), name="eagle3",
                        tree={"total_tokens": 10, "depth": 4, "top_k": 3})
    return root


def _greedy(root, drafter, backend):
    s = Session.open(root, drafter=drafter, backend=backend, max_context=256)
    try:
        return s.generate(PROMPT, GenerationParams(max_tokens=24)).token_ids
    finally:
        s.close()


def test_greedy_sessions_with_eagle_heads_equal_plain_decoding(eagle_bundle):
    want = _greedy(eagle_bundle, "none", "numpy_ref")
    for name in ("eagle", "eagle2", "eagle3"):
        assert _greedy(eagle_bundle, name, "numpy_ref") == want, name


@pytest.mark.slow
def test_onnx_graph_without_the_eagle3_taps_is_refused_at_session_creation(eagle_bundle, tmp_path):
    from export.onnx import add_onnx_to_bundle

    root = str(tmp_path / "bundle")
    shutil.copytree(eagle_bundle, root)
    add_onnx_to_bundle(root, "fp32", ["final_norm"], validate=False)
    with pytest.raises(BundleError, match=r"layer_in\.0.*--taps final_norm layer_in\.0 layer_in\.1 layer_in\.2"):
        Session.open(root, drafter="eagle3", backend="onnx", max_context=256)
    assert _greedy(root, "eagle2", "onnx") == _greedy(root, "none", "numpy_ref")  # final_norm is there
