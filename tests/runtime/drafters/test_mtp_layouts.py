"""MTP modules in the Qwen3-Next (`mtp.*`) and MiMo (`model.mtp_layers.*`, concat order [hidden, emb]) layouts:
a checkpoint written in each official key layout (built here from the DeepSeek-V3 module of a tiny model, keys
renamed, MiMo's projection columns swapped to its order) drafts exactly what the DeepSeek-V3 module drafts; the
bundle builder finds each layout and its module count; a missing key is named."""
import numpy as np
import pytest

from export.bundle.builder import mtp_layout, split_mtp
from runtime.drafters.base import DraftContext
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.errors import BundleError
from runtime.memory.kv import KVArena
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.sampling import SamplingParams
from tests.runtime.drafters.test_mtp_drafter import mtp_model  # noqa: F401  (the fixture)

OWN = {"qwen3_next": {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden", "eh_proj": "mtp.fc",
                      "shared_head.norm": "mtp.norm"},
       "mimo": {"enorm": "model.mtp_layers.0.token_layernorm", "hnorm": "model.mtp_layers.0.hidden_layernorm",
                "eh_proj": "model.mtp_layers.0.input_proj", "shared_head.norm": "model.mtp_layers.0.final_layernorm"}}
LAYER = {"qwen3_next": "mtp.layers.0.", "mimo": "model.mtp_layers.0."}


def relayout(weights, n, layout, H):
    """The DeepSeek-V3 module at model.layers.{n} renamed into `layout`'s official keys."""
    p = f"model.layers.{n}."
    out = {k: v for k, v in weights.items() if not k.startswith(p)}
    for k, v in weights.items():
        if not k.startswith(p):
            continue
        rest = k[len(p):]
        own = next((o for o in OWN[layout] if rest == o + ".weight"), None)
        if own is not None:
            if own == "eh_proj" and layout == "mimo":
                v = np.concatenate([v[:, H:], v[:, :H]], axis=1)  # MiMo concatenates [hidden, emb]
            out[OWN[layout][own] + ".weight"] = v
        else:
            out[LAYER[layout] + rest] = v
    return out


def first_q(spec, weights, layout):
    arena = KVArena.for_context({"t": cache_shape(spec), "m": mtp_cache_shape(spec)}, 64)
    target = NumpyTarget(spec, weights, arena.allocate("t", cache_shape(spec), 48))
    embed = target.w["model.embed_tokens.weight"]
    drafter = MTPDrafter(spec, weights, embed, embed, arena.allocate("m", mtp_cache_shape(spec), 56), 2, layout=layout)
    ids = [5, 9, 17, 3, 44, 8, 2]
    res = target.forward(np.array(ids), np.arange(len(ids)), taps=drafter.target_taps)
    drafter.begin(ids, res.taps)
    tree = drafter.propose(DraftContext(ids + [60], SamplingParams(temperature=1.0), np.random.default_rng(0), 8))
    return tree.q


@pytest.mark.parametrize("layout", ["qwen3_next", "mimo"])
def test_each_official_layout_drafts_what_the_deepseek_module_drafts(mtp_model, layout):
    _, spec, weights = mtp_model
    want = first_q(spec, weights, "deepseek_v3")
    got = first_q(spec, relayout(weights, spec.num_layers, layout, spec.hidden_size), layout)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_mimo_order_matters(mtp_model):
    """The same tensors read with the DeepSeek concat order give another draft: the swap is not a no-op."""
    _, spec, weights = mtp_model
    mimo = relayout(weights, spec.num_layers, "mimo", spec.hidden_size)
    wrong = dict(mimo)
    W = mimo["model.mtp_layers.0.input_proj.weight"]
    wrong["model.mtp_layers.0.input_proj.weight"] = np.concatenate([W[:, spec.hidden_size:], W[:, :spec.hidden_size]], 1)
    assert not np.allclose(first_q(spec, wrong, "mimo"), first_q(spec, mimo, "mimo"))


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next", "mimo"])
def test_the_bundle_builder_splits_each_layout(mtp_model, layout):
    _, spec, weights = mtp_model
    w = weights if layout == "deepseek_v3" else relayout(weights, spec.num_layers, layout, spec.hidden_size)
    body, mtp = split_mtp(w, spec.num_layers)
    assert mtp and not any("mtp" in k or k.startswith(f"model.layers.{spec.num_layers}.") for k in body)
    assert mtp_layout(mtp, spec.num_layers) == (layout, 1)


@pytest.mark.parametrize("layout, key", [("qwen3_next", "mtp.pre_fc_norm_hidden.weight"),
                                         ("mimo", "model.mtp_layers.0.token_layernorm.weight")])
def test_a_missing_key_is_named(mtp_model, layout, key):
    _, spec, weights = mtp_model
    w = relayout(weights, spec.num_layers, layout, spec.hidden_size)
    del w[key]
    with pytest.raises(BundleError, match=key.replace(".", r"\.")):
        first_q(spec, w, layout)
