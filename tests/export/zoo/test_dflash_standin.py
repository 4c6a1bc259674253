"""The zoo's DFlash and DFlash-2 drafters, padded for the stand-in (export/zoo/standin.py `widen_dflash`), draft
on the stand-in what they draft on the zoo target: the same block logits, the same greedy block and the same
sampled DFlash-2 walk with the same q handed to the verifier (T = 1). Checked on the small widening of
tests/export/zoo/test_zoo_standin.py (hidden 256 -> 384, 8/4 heads -> 12/4, conv groups 16 -> 24); `edgespec zoo standin`
sizes use the same code."""
import os

import numpy as np
import pytest

from export.drafters.dflash import read_dflash_checkpoint
from export.zoo.standin import widen_dflash, write_standin_dflash
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.base import DraftContext
from runtime.drafters.dflash import DFlashDrafter
from runtime.memory.kv import CacheShape, KVArena
from runtime.sampling import SamplingParams
from tests.export.zoo.test_zoo_standin import ZOO_TARGET, zoo_and_standin  # noqa: F401 (the fixture)

ZOO = os.path.dirname(ZOO_TARGET)
IDS = [1, 5, 300, 41, 77, 912, 8, 1500, 23, 640, 12, 99]


def block(ckpt, drafter_dir, params):
    """(block logits (B-1, V), drafted tokens, q or None) of one drafter cycle after IDS on target `ckpt`."""
    d = read_dflash_checkpoint(drafter_dir, ckpt.spec)
    dshape = CacheShape(d.spec.num_layers, d.spec.num_kv_heads, d.spec.head_dim)
    arena = KVArena.for_context({"t": cache_shape(ckpt.spec), "d": dshape}, 128)
    target = NumpyTarget(ckpt.spec, ckpt.weights, arena.allocate("t", cache_shape(ckpt.spec), 64))
    drafter = DFlashDrafter(d.spec, d.params, d.weights, target.w["model.embed_tokens.weight"], target.lm_head,
                            arena.allocate("d", dshape, 64))
    res = target.forward(np.array(IDS[:-1]), np.arange(len(IDS) - 1), taps=drafter.target_taps)
    drafter.begin(IDS[:-1], res.taps)
    forward, seen = drafter.forward, []
    drafter.forward = lambda *a: seen.append(forward(*a)) or seen[-1]
    tree = drafter.propose(DraftContext(IDS, params, np.random.default_rng(0), 64))
    return seen[0][1], tree.tokens.tolist(), tree.q


@pytest.fixture(scope="module")
def padded(zoo_and_standin, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("dflash_standin")
    for name in ("dflash", "dflash2"):
        write_standin_dflash(os.path.join(ZOO, name), str(out / name), hidden=384, intermediate=1024, kv_heads=4)
    return str(out)


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_padded_drafters_draft_on_the_standin_what_the_zoo_drafters_draft_on_the_zoo(zoo_and_standin, padded, name):  # noqa: F811
    zoo, standin, _ = zoo_and_standin
    # top_k 20 at T = 1: over the full vocabulary the cdf of an undertrained drafter's flat tail differs by ~5e-7
    # between the two float sums, enough to move an inverse-CDF draw to the neighbouring token once in a while
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=20)):
        logits, tokens, q = block(zoo, os.path.join(ZOO, name), params)
        wide_logits, wide_tokens, wide_q = block(standin, os.path.join(padded, name), params)
        assert np.max(np.abs(wide_logits - logits)) < 1e-3 * np.max(np.abs(logits))  # ~1e-6 relative seen
        assert wide_tokens == tokens and len(tokens) == 15
        if q is not None:  # the walk's q (DFlash-2) / the slot's q (DFlash) the verifier gets
            assert np.max(np.abs(wide_q - q)) < 1e-4


def test_padded_dflash2_keeps_every_original_channel_in_its_conv_group():
    rng = np.random.default_rng(0)
    h, group, rank = 64, 16, 8  # 4 groups -> 8 groups at 128
    cfg = {"hidden_size": h, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "dflash_config": {"conv_group_size": group}}
    kp = rng.standard_normal((2 * 2 * (h // group), h)).astype(np.float32)
    w, new_cfg = widen_dflash({"layers.0.mlp_conv.kernel_projection.weight": kp,
                               "candidate_selector.hidden_projection.weight": np.ones((rank, h), np.float32)},
                              cfg, 128, 128, 2)
    x = rng.standard_normal(h).astype(np.float32)
    dyn = kp @ x  # (in/out * taps * G) as the drafter reshapes it: (2, 2, G)
    wide = w["layers.0.mlp_conv.kernel_projection.weight"] @ np.concatenate([x, np.zeros(64, np.float32)])
    np.testing.assert_array_equal(wide.reshape(2, 2, 8)[..., :4], dyn.reshape(2, 2, 4))
    assert not wide.reshape(2, 2, 8)[..., 4:].any()
    assert w["candidate_selector.hidden_projection.weight"].shape == (rank, 128)
    assert new_cfg["hidden_size"] == 128 and new_cfg["dflash_config"] == cfg["dflash_config"]


def test_standin_bundle_gets_the_padded_drafters_under_the_zoo_names(zoo_and_standin, tmp_path):  # noqa: F811
    """`edgespec zoo standin --bundle`'s hook (`add_standin_dflash`) on the small widening: the stand-in bundle
    gets dflash, dflash_b8, dflash2, dflash2_b8, and greedy decoding with one equals plain decoding."""
    from export.bundle.builder import build_bundle
    from export.zoo.standin import add_standin_dflash
    from runtime.serving.session import GenerationParams, Session

    standin = zoo_and_standin[1]
    added = []
    out = build_bundle(standin.path, str(tmp_path / "bundle-standin"), extend=lambda staged: added.extend(
        add_standin_dflash(ZOO, str(tmp_path / "heads"), staged, 384, 1024, 4)))
    assert sorted(added) == ["dflash", "dflash2", "dflash2_b8", "dflash_b8"]
    params = GenerationParams(max_tokens=12)
    plain = Session.open(out, drafter="none", backend="numpy_ref").generate("To be, or not to be", params)
    res = Session.open(out, drafter="dflash2_b8", backend="numpy_ref").generate("To be, or not to be", params)
    assert res.token_ids == plain.token_ids and res.stats.drafter == "dflash2_b8" and res.stats.cycles > 0
