"""The zoo's EAGLE-1 and EAGLE-3 heads, padded for the stand-in (export/zoo/standin.py `widen_eagle`), predict
on the stand-in what they predict on the zoo target: the same draft distributions q along a sampled chain
(T = 1) and the same EAGLE-2 dynamic tree. Checked on the small widening of tests/export/zoo/test_zoo_standin.py
(hidden 256 -> 384, 8/4 heads -> 12/4); `edgespec zoo standin` sizes use the same code."""
import os

import numpy as np
import pytest

from export.drafters.eagle import load_eagle
from export.zoo.standin import write_standin_eagle
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.base import DraftContext
from runtime.drafters.eagle import DynamicTree, EagleDrafter
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams
from tests.export.zoo.test_zoo_standin import ZOO_TARGET, zoo_and_standin  # noqa: F401 (the fixture)

ZOO = os.path.dirname(ZOO_TARGET)
IDS = [1, 5, 300, 41, 77, 912, 8, 1500, 23, 640, 12, 99]


def drafts(ckpt, heads_dir, kind, tree):
    """(tokens, q) the head drafts after IDS on target `ckpt` (numpy reference, sampled chain or dynamic tree)."""
    head = load_eagle(heads_dir, ckpt.spec, kind)
    arena = KVArena.for_context({"t": cache_shape(ckpt.spec), "d": cache_shape(head.spec)}, 128)
    target = NumpyTarget(ckpt.spec, ckpt.weights, arena.allocate("t", cache_shape(ckpt.spec), 64))
    embed = target.w["model.embed_tokens.weight"]
    drafter = EagleDrafter(head.kind, head.spec, head.weights, embed, embed, arena.allocate("d", cache_shape(head.spec), 64),
                           head.params, num_tokens=4, tree=tree)
    res = target.forward(np.array(IDS[:-1]), np.arange(len(IDS) - 1), taps=drafter.target_taps)
    drafter.begin(IDS[:-1], res.taps)
    t = drafter.propose(DraftContext(IDS, SamplingParams(temperature=1.0), np.random.default_rng(0), 16))
    return t.tokens.tolist(), t.q


@pytest.fixture(scope="module")
def padded_heads(zoo_and_standin, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle_standin")
    for name in ("eagle1", "eagle3"):
        write_standin_eagle(os.path.join(ZOO, name), str(out / name), hidden=384, intermediate=1024, kv_heads=4)
    return str(out)


@pytest.mark.parametrize("kind,name", [("eagle", "eagle1"), ("eagle3", "eagle3")])
def test_padded_heads_draft_on_the_standin_what_the_zoo_heads_draft_on_the_zoo(zoo_and_standin, padded_heads,  # noqa: F811
                                                                              kind, name):
    zoo, standin, _ = zoo_and_standin
    tokens, q = drafts(zoo, os.path.join(ZOO, name), kind, None)
    wide_tokens, wide_q = drafts(standin, os.path.join(padded_heads, name), kind, None)
    # float32 sums reordered by the padding move the trained heads' peaked logits by ~1e-3 (q by ~1e-4); a
    # wrong padding (a norm not rescaled, a zero block that is not zero) moves q by orders of magnitude more
    assert wide_tokens == tokens and np.max(np.abs(wide_q - q)) < 1e-3
    tree = DynamicTree(total_tokens=8, depth=4, top_k=3)
    assert drafts(standin, os.path.join(padded_heads, name), kind, tree)[0] == drafts(zoo, os.path.join(ZOO, name), kind, tree)[0]
