"""One's own model behind the ROS node: a Llama-3-style checkpoint with its chat template, bundled by the real
export path, served by the node; the Plan service prompts it with the bundle's chat-rendered planner template
(the answer equals the in-process Session's for the same request), not with the zoo's template."""
from __future__ import annotations

import pytest

from export.bundle.builder import build_bundle
from runtime.serving.session import GenerationParams, Session
from tests.support.chat_checkpoints import save_checkpoint
from tests.ros.conftest import connect, start_node

NS = "/own"
PATH = f"{NS}/edgespec"


@pytest.fixture(scope="module")
def own_bundle(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("own"))
    return build_bundle(save_checkpoint(root, "llama3"), f"{root}/bundle")


@pytest.fixture(scope="module")
def served(own_bundle, client_node, tmp_path_factory):
    node = start_node(str(tmp_path_factory.mktemp("own_node")), NS,
                      {"bundle": own_bundle, "drafter": "ngram", "autostart": True, "default_max_tokens": 12})
    client = connect(client_node, node, PATH)
    yield client, node
    rc = node.stop()
    assert rc == 0, f"node exited with {rc}; log:\n{node.log()}"


def test_the_plan_service_prompts_ones_own_model_with_its_chat_template(served, own_bundle):
    client, _ = served
    resp = client.plan(instruction="bring the red cup to the table", context="cup not on the shelf", max_tokens=12)
    assert resp.success, resp.message
    s = Session.open(own_bundle, drafter="none")
    try:  # the node joins context and observation as "context\nObservation: ..." (here: no observation)
        want = s.plan("bring the red cup to the table", "cup not on the shelf", GenerationParams(max_tokens=12))
    finally:
        s.close()
    assert resp.stats.tokens == want.stats.tokens
    # a ROS string ends at a NUL byte, which a random model may well decode to
    assert resp.text == want.text.split("\x00")[0] and len(resp.text) > 0
