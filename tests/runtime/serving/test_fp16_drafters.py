"""Every drafter runs on an fp16 ONNX bundle (the Jetson path: `edgespec export --to onnx --precision fp16`) and
leaves greedy output token-identical to plain decoding on that same fp16 target.

An fp16 target makes the session's KV arena float16 (each drafter's own cache rows with it) and gives float16
taps, while the EAGLE and DFlash graphs are float32: the drafter graphs take their feeds in the dtypes they
declare (runtime/backends/onnx_net.py). A speculative output may leave plain decoding's only at a near-tie of
the fp16 target's own logits (a batched verify and a one-token step round differently); the test checks that
any divergence is one (gap < 1e-2 between the two tokens), and there was none when this was written.

The bundle: a copy of the zoo (it has every drafter kind) exported fp16 once per module (~1 min of CPU)."""
import os
import shutil

import numpy as np
import pytest

from tests.support import REPO_ROOT

ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")
DRAFTERS = ["eagle", "eagle2", "eagle3", "eagle3_chain", "dflash", "dflash2", "mtp", "medusa", "draft_model", "ngram"]
PROMPTS = ["<|bos|><|plan|>pick up the red cup<|sep|>", "<|bos|><|text|>the robot"]
TOKENS = 40

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")), reason="no zoo bundle: run `make bundles`")]


@pytest.fixture(scope="module")
def fp16_zoo(tmp_path_factory):
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("fp16") / "zoo")
    shutil.copytree(ZOO, root)  # never export into build/
    add_onnx_to_bundle(root, "fp16", validate=False)
    return root


@pytest.fixture(scope="module")
def plain(fp16_zoo):
    from runtime.serving.session import GenerationParams, Session

    s = Session.open(fp16_zoo, drafter="none", backend="onnx", max_context=256)
    assert s.target.cache.k.dtype == np.float16  # the fp16 graph, not a float32 fallback
    return s, [s.generate(p, GenerationParams(max_tokens=TOKENS)).token_ids for p in PROMPTS]


def assert_divergence_is_a_near_tie(target, prompt, want, got, gap=1e-2):
    """The first token where `got` leaves plain output `want` had plain decoding's own logits within `gap`."""
    k = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    target.reset()
    ctx = list(prompt) + list(want[:k])
    row = target.forward(np.asarray(ctx), np.arange(len(ctx))).logits[-1]
    assert abs(float(row[want[k]]) - float(row[got[k]])) < gap, (k, want[k], got[k])


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_on_an_fp16_bundle_keeps_greedy_output_of_plain_fp16_decoding(fp16_zoo, plain, drafter):
    from runtime.serving.session import GenerationParams, Session

    base, want = plain
    s = Session.open(fp16_zoo, drafter=drafter, backend="onnx", max_context=256)
    try:
        for prompt, ids in zip(PROMPTS, want):
            out = s.generate(prompt, GenerationParams(max_tokens=TOKENS))
            if out.token_ids != ids:
                assert_divergence_is_a_near_tie(base.target, s.tokenizer.encode(prompt), ids, out.token_ids)
            assert out.stats.cycles < len(out.token_ids)  # drafts were accepted: the drafter really ran
    finally:
        s.close()
