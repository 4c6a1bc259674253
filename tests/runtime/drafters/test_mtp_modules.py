"""k MTP modules for k tokens (DeepSeek-V3 layout, model.layers.{N+i}): the bundle builder finds both modules of a
tiny 2-module checkpoint, draft depth i+1 uses module i on module i-1's output and the token it drafted (the last
module reused autoregressively beyond), the incremental caches draft exactly what a from-scratch recomputation
drafts, greedy decoding stays identical to plain, and a checkpoint missing a key is refused naming it."""
import os

import numpy as np
import pytest

from runtime.model import bundle as bundle_mod
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.base import DraftContext
from runtime.drafters.mtp import MTPDrafter, MTPModule, module_keys, mtp_cache_shape
from runtime.decode.engine import Engine
from runtime.errors import BundleError
from runtime.memory.kv import CacheShape, KVArena
from runtime.model.spec import ModelSpec
from runtime.sampling import SamplingParams
from runtime.model.tensors import read_safetensors
from tests.support.mtp_tiny import LAYERS, mtp_weights


@pytest.fixture(scope="module")
def two_modules():
    w = mtp_weights(97, modules=2, seed=1)
    spec = ModelSpec.from_hf_config(w.pop("config"))
    return spec, w


def build(spec, w, modules=2, k=3, positions=96):
    shapes = {"t": cache_shape(spec), "m": CacheShape(modules, spec.num_kv_heads, spec.head_dim)}
    arena = KVArena.for_context(shapes, positions + 8)
    target = NumpyTarget(spec, w, arena.allocate("t", cache_shape(spec), positions))
    embed = target.w["model.embed_tokens.weight"]
    caches = [arena.allocate(f"m{i}", mtp_cache_shape(spec), positions + 8) for i in range(modules)]
    return target, MTPDrafter(spec, w, embed, embed, caches, k)


def recomputed_drafts(spec, w, target, tokens, depth):
    """Greedy drafts from fresh modules over the whole context (no kept rows): module i reads module i-1's
    outputs at every row and x_{t+1+i}; after the last module, it runs again on its own output."""
    embed = target.w["model.embed_tokens.weight"]
    n = len(tokens)
    taps = NumpyTarget(spec, w, KVArena.for_context({"t": cache_shape(spec)}, n).allocate("t", cache_shape(spec), n)) \
        .forward(np.array(tokens[:-1]), np.arange(n - 1), taps=(f"layer_out.{LAYERS - 1}",)).taps
    hidden = taps[f"layer_out.{LAYERS - 1}"]
    seq = list(tokens)
    mods = []
    for i in range(2):
        cache = KVArena.for_context({"m": mtp_cache_shape(spec)}, n + 8).allocate("m", mtp_cache_shape(spec), n + 8)
        mods.append(MTPModule(spec, w, module_keys("deepseek_v3", i, LAYERS), "deepseek_v3", cache, embed, embed))
    for j in range(depth):
        if j < 2:
            hidden, logits = mods[j].run(hidden, seq[1 + j:n + j], 0)
        else:
            out, logits = mods[1].run(hidden[-1:], [seq[-1]], n - 2 + j - 1)
            hidden = out
        seq.append(int(np.argmax(logits)))
    return seq[n:]


def test_each_draft_depth_uses_its_module_and_kept_rows_draft_what_a_recomputation_drafts(two_modules):
    spec, w = two_modules
    target, drafter = build(spec, w, k=4)
    proposals = []
    real = drafter.propose

    def record(ctx):
        tree = real(ctx)
        proposals.append((list(ctx.tokens), [int(t) for t in tree.tokens]))
        return tree

    drafter.propose = record
    Engine(target, drafter, eos_ids=[]).generate([5, 9, 17, 3, 44, 8], SamplingParams(), 30)
    assert len(proposals) >= 5
    for tokens, drafted in proposals:
        assert drafted == recomputed_drafts(spec, w, target, tokens, len(drafted)), tokens


def test_module_one_changes_the_second_draft(two_modules):
    """The power control: the same drafter with module 1 reading module 0's weights drafts otherwise at depth 2."""
    spec, w = two_modules
    same = dict(w)
    for k, v in w.items():
        if k.startswith(f"model.layers.{LAYERS}."):
            same[f"model.layers.{LAYERS + 1}." + k[len(f"model.layers.{LAYERS}."):]] = v
    qs = []
    for weights in (w, same):
        target, drafter = build(spec, weights, k=2)
        ids = [5, 9, 17, 3, 44, 8, 2]
        res = target.forward(np.array(ids), np.arange(len(ids)), taps=drafter.target_taps)
        drafter.begin(ids, res.taps)
        qs.append(drafter.propose(DraftContext(ids + [60], SamplingParams(temperature=1.0), np.random.default_rng(0), 8)).q)
    assert np.allclose(qs[0][0], qs[1][0]) and not np.allclose(qs[0][1], qs[1][1])


def test_greedy_decoding_with_two_modules_is_token_identical_to_plain(two_modules):
    spec, w = two_modules
    rng = np.random.default_rng(4)
    for _ in range(6):
        prompt = [int(t) for t in rng.integers(0, spec.vocab_size, 8)]
        plain = Engine(build(spec, w)[0], None, eos_ids=[]).generate(prompt, SamplingParams(), 24)
        for k in (1, 2, 5):
            target, drafter = build(spec, w, k=k)
            got = Engine(target, drafter, eos_ids=[]).generate(prompt, SamplingParams(), 24)
            assert got.tokens == plain.tokens


def test_the_bundle_builder_reads_a_two_module_checkpoint_and_the_session_runs_both(tmp_path):
    from export.bundle.builder import build_bundle
    from runtime.serving.session import GenerationParams, Session
    from tests.support.mtp_tiny import write_mtp_checkpoint

    out = build_bundle(write_mtp_checkpoint(str(tmp_path), modules=2), str(tmp_path / "bundle"), name="mtp2")
    b = bundle_mod.load(out)
    assert b.drafters["mtp"].params["num_modules"] == 2
    assert f"model.layers.{LAYERS + 1}.eh_proj.weight" in read_safetensors(b.path(b.drafters["mtp"].files[0]))
    s = Session.open(out, drafter="mtp", backend="numpy_ref", num_tokens=3)
    assert len(s.drafter.modules) == 2 and s.drafter.backend == "numpy"
    plain = Session.open(out, drafter="none", backend="numpy_ref")
    prompt = "<|bos|><|text|>open the drawer"
    assert s.generate(prompt, GenerationParams(max_tokens=16)).token_ids == \
        plain.generate(prompt, GenerationParams(max_tokens=16)).token_ids


@pytest.mark.parametrize("key", [f"model.layers.{LAYERS + 1}.hnorm.weight",
                                 f"model.layers.{LAYERS + 1}.mlp.down_proj.weight"])
def test_a_module_missing_a_key_is_refused_naming_it(two_modules, key):
    spec, w = two_modules
    broken = {k: v for k, v in w.items() if k != key}
    with pytest.raises(BundleError, match=key.replace(".", r"\.")):
        build(spec, broken)
