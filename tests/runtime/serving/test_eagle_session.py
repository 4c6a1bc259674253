"""EAGLE heads added to a real bundle run in a Session: greedy output equals plain decoding on numpy_ref and on
ONNX Runtime (tests/export/onnx/test_eagle_onnx.py: the heads' own graphs, and a target graph without the taps a head reads)."""
import shutil

import pytest

from export.drafters.eagle import add_eagle_to_bundle
from runtime.model import bundle as bundle_io
from runtime.serving.session import GenerationParams, Session
from tests.support.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint

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


def test_the_stats_name_the_drafter_the_user_chose_not_its_kind(eagle_bundle):
    s = Session.open(eagle_bundle, drafter="eagle2", backend="numpy_ref", max_context=256)  # kind eagle
    try:
        assert s.generate(PROMPT, GenerationParams(max_tokens=4)).stats.drafter == "eagle2"
    finally:
        s.close()
