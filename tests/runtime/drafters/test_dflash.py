"""DFlash and DFlash-2 drafters: official-layout checkpoints load (and malformed ones are refused by key),
a bundle carries them to a Session, greedy decoding with them is token-identical to plain decoding, and
under sampling the first emitted token and the first two keep the target's law (chi-square, alpha 0.001,
800 draws, fixed seeds, T = 1 and 0.6) with the DFlash-2 path selector's SAMPLED walk; handing the verifier the slot's marginal
instead of the walk's conditional q (a plausible mistake) is caught by the same test.

The checkpoints are written here, key by key, in the z-lab layout (this list is the test's own, not the
runtime's): Qwen3 draft layers with q/k norms, `fc` + `hidden_norm` over target layer outputs, `norm`; no
embedding, no lm_head; DFlash-2 adds per-layer `attention_conv` / `mlp_conv` and `candidate_selector` with
codebooks stored WITHOUT `.weight`."""
import json
import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from export.drafters.dflash import read_dflash_checkpoint
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify
from runtime.drafters.base import DraftContext
from runtime.drafters import registry
from runtime.drafters.dflash import DFlashDrafter
from runtime.decode.engine import Engine
from runtime.errors import BundleError
from runtime.memory.kv import KVArena, CacheShape
from runtime.sampling import SamplingParams
from runtime.model.tensors import write_safetensors
from tests.support.hf_tiny import tiny_hf_model

ALPHA = 1e-3
DRAWS = 800
V, H, HEADS, KV_HEADS, HEAD_DIM, FF = 97, 64, 4, 2, 16, 96
LAYER_IDS = [0, 2]


@pytest.fixture(scope="module")
def target():
    _, spec, weights = tiny_hf_model("qwen3", seed=3, num_layers=4)
    return spec, weights


def official_weights(v2: bool, layers: int = 2, rank: int = 8, groups: int = 4, seed: int = 0,
                     selector_scale: float = 1.0):
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.15):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    w = {"fc.weight": rand(H, len(LAYER_IDS) * H), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + rand(H), p + "post_attention_layernorm.weight": 1 + rand(H),
                  p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, H),
                  p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, H),
                  p + "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
                  p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM), p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
                  p + "mlp.gate_proj.weight": rand(FF, H), p + "mlp.up_proj.weight": rand(FF, H),
                  p + "mlp.down_proj.weight": rand(H, FF)})
        if v2:
            for m in ("attention_conv", "mlp_conv"):
                base = rand(2, 2, H, scale=0.3)
                base[:, 0] += 1.0  # near identity: x_t plus a little of x_{t-1}
                w[p + f"{m}.base_kernel"] = base
                w[p + f"{m}.kernel_projection.weight"] = rand(2 * 2 * groups, H, scale=0.1)
    if v2:
        w["candidate_selector.hidden_projection.weight"] = rand(rank, H, scale=selector_scale)
        w["candidate_selector.predecessor_codebook"] = rand(V, rank, scale=selector_scale)
        w["candidate_selector.successor_codebook"] = rand(V, rank, scale=selector_scale)
    return w


def official_config(v2: bool, layers: int = 2, block: int = 5, rank: int = 8, top_k: int = 4) -> dict:
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "intermediate_size": FF, "vocab_size": V, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "block_size": block, "num_target_layers": 4,
           "dflash_config": {"target_layer_ids": LAYER_IDS, "mask_token_id": V - 1}}
    if v2:
        cfg["dflash_config"].update(conv_group_size=H // 4, conv_kernel_size=2, selector_rank=rank, selector_top_k=top_k)
    return cfg


def write_checkpoint(path: str, cfg: dict, weights: dict, fp16: bool = True) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(os.path.join(path, "model.safetensors"),
                      {k: v.astype(np.float16) if fp16 else v for k, v in weights.items()})
    return path


# -- loaders ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v2", [False, True], ids=["dflash", "dflash2"])
def test_loader_accepts_the_official_layout(tmp_path, target, v2):
    spec, _ = target
    ck = read_dflash_checkpoint(write_checkpoint(str(tmp_path), official_config(v2), official_weights(v2)), spec)
    assert ck.kind == ("dflash2" if v2 else "dflash")
    assert ck.params.target_layer_ids == tuple(LAYER_IDS) and ck.params.block_size == 5
    assert ck.params.mask_token_id == V - 1 and ck.spec.qk_norm and ck.spec.num_layers == 2
    if v2:
        assert (ck.params.selector_top_k, ck.params.selector_rank, ck.params.conv_group_size) == (4, 8, 16)
        assert "candidate_selector.successor_codebook" in ck.weights


def test_loader_reads_target_layer_ids_default_when_absent(tmp_path, target):
    spec, _ = target
    cfg = official_config(False)
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["num_target_layers"] = 8
    big = dict(spec.__dict__)
    ck = read_dflash_checkpoint(write_checkpoint(str(tmp_path), cfg, official_weights(False)))
    assert ck.params.target_layer_ids == (1, 5)  # evenly spaced from 1 to N - 3 (N = 8), one per draft layer
    assert big  # the target is not needed to read a checkpoint


def _broken(kind: str):
    v2 = kind.startswith("v2")
    cfg, w = official_config(v2), official_weights(v2)
    if kind == "missing_key":
        del w["layers.1.self_attn.k_norm.weight"]
    elif kind == "v2_codebook_with_weight_suffix":
        w["candidate_selector.successor_codebook.weight"] = w.pop("candidate_selector.successor_codebook")
    elif kind == "wrong_shape":
        w["fc.weight"] = w["fc.weight"][:, :H]
    elif kind == "v2_keys_in_a_v1_config":
        cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if k not in
                                ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")}
    elif kind == "v2_partial_config":
        del cfg["dflash_config"]["selector_rank"]
    elif kind == "layer_beyond_target":
        cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    elif kind == "no_mask_token":
        del cfg["dflash_config"]["mask_token_id"]
    elif kind == "embedding_included":
        w["embed_tokens.weight"] = np.zeros((V, H), np.float32)
    return cfg, w


@pytest.mark.parametrize("kind, needle", [
    ("missing_key", "layers.1.self_attn.k_norm.weight"),
    ("v2_codebook_with_weight_suffix", "without `.weight`"),
    ("wrong_shape", "'fc.weight' has shape"),
    ("v2_keys_in_a_v1_config", "selector_top_k"),
    ("v2_partial_config", "selector_rank"),
    ("layer_beyond_target", "target_layer_ids has 9"),
    ("no_mask_token", "mask_token_id"),
    ("embedding_included", "unexpected tensor 'embed_tokens.weight'"),
])
def test_loader_rejects_malformed_checkpoints_naming_the_key(tmp_path, target, kind, needle):
    spec, _ = target
    cfg, w = _broken(kind)
    with pytest.raises(BundleError, match=None) as err:
        read_dflash_checkpoint(write_checkpoint(str(tmp_path), cfg, w), spec)
    assert needle in str(err.value), str(err.value)


# -- the drafter in the engine ------------------------------------------------------------------------


def build(spec, weights, v2: bool, positions: int = 96, drafter_cls=DFlashDrafter, **ck):
    cfg = official_config(v2, **{k: ck[k] for k in ("layers", "block", "top_k") if k in ck})
    w = official_weights(v2, **{k: ck[k] for k in ("layers", "seed", "selector_scale") if k in ck})
    from export.drafters.dflash import DFlashCheckpoint  # noqa: F401  (the same reader as the bundle path)
    from runtime.drafters.dflash import DFlashParams
    from runtime.model.spec import ModelSpec

    dspec = ModelSpec.from_hf_config(cfg)
    params = DFlashParams.from_dict(dict(cfg["dflash_config"], block_size=cfg["block_size"],
                                         sampled_walk=ck.get("sampled_walk", False)), "test")
    dshape = CacheShape(dspec.num_layers, dspec.num_kv_heads, dspec.head_dim)
    arena = KVArena.for_context({"t": cache_shape(spec), "d": dshape}, positions + 16)
    tgt = NumpyTarget(spec, weights, arena.allocate("t", cache_shape(spec), positions))
    embed = tgt.w["model.embed_tokens.weight"]
    drafter = drafter_cls(dspec, params, w, embed, tgt.lm_head, arena.allocate("d", dshape, positions + params.block_size))
    return tgt, drafter


@pytest.mark.parametrize("v2", [False, True], ids=["dflash", "dflash2"])
def test_greedy_decoding_with_dflash_is_token_identical_to_plain(target, v2):
    spec, weights = target
    rng = np.random.default_rng(5)
    drafted = 0
    for _ in range(6):
        prompt = [int(t) for t in rng.integers(0, V, 7)]
        tgt, _ = build(spec, weights, v2)
        plain = Engine(tgt, None).generate(prompt, SamplingParams(), 30).tokens
        tgt, drafter = build(spec, weights, v2)
        out = Engine(tgt, drafter).generate(prompt, SamplingParams(), 30)
        assert out.tokens == plain
        drafted += out.stats.cycles
    assert drafted > 0


def test_one_forward_drafts_the_whole_block_and_caches_only_context_rows(target):
    spec, weights = target
    tgt, drafter = build(spec, weights, True, block=5, sampled_walk=True)
    prompt = [3, 14, 15, 92, 65, 35]
    res = tgt.forward(np.asarray(prompt), np.arange(len(prompt)), taps=drafter.target_taps)
    drafter.begin(prompt, res.taps)
    calls = []
    forward = drafter.forward
    drafter.forward = lambda *a: calls.append(a) or forward(*a)
    tree = drafter.propose(DraftContext(prompt + [7], SamplingParams(temperature=1.0), np.random.default_rng(0), 64))
    assert len(calls) == 1 and len(tree) == 4 and tree.parents.tolist() == [-1, 0, 1, 2]
    assert drafter.cache.length == len(prompt)  # the block's rows were temporary
    np.testing.assert_allclose(tree.q.sum(axis=1), 1.0)
    assert all((q > 0).sum() <= 4 for q in tree.q)  # the walk's q lives on the slot's top-K candidates


def test_a_sampled_dflash2_draws_from_its_slot_marginals_unless_the_bundle_asks_for_the_sampled_walk(target):
    """By default (`sampled_walk: false`, measured to pay more at T = 1) each slot's q is its own processed
    distribution over the whole vocabulary, as DFlash's; greedy always walks."""
    from runtime.sampling import process_logits
    spec, weights = target
    prompt = [3, 14, 15, 92, 65, 35]
    sampled = SamplingParams(temperature=1.0)
    for walk in (False, True):
        tgt, drafter = build(spec, weights, True, block=5, sampled_walk=walk)
        res = tgt.forward(np.asarray(prompt), np.arange(len(prompt)), taps=drafter.target_taps)
        drafter.begin(prompt, res.taps)
        seen = []
        forward = drafter.forward
        drafter.forward = lambda *a: seen.append(forward(*a)) or seen[-1]
        tree = drafter.propose(DraftContext(prompt + [7], sampled, np.random.default_rng(0), 64))
        _, logits = seen[0]
        marginals = np.stack([process_logits(logits[t], sampled, prompt + [7] + tree.tokens[:t].tolist(), None)
                              for t in range(len(tree))])
        assert (drafter.last_walk is not None) == walk
        if walk:
            assert all((q > 0).sum() <= 4 for q in tree.q)
        else:
            np.testing.assert_allclose(tree.q, marginals, rtol=1e-6, atol=1e-9)
    with pytest.raises(BundleError, match="sampled_walk"):
        from runtime.drafters.dflash import DFlashParams
        DFlashParams.from_dict({"block_size": 4, "mask_token_id": 0, "target_layer_ids": [1], "sampled_walk": "yes"}, "x")


def test_session_refuses_a_backend_without_the_drafters_taps(target):
    from runtime.serving.session import check_taps

    spec, weights = target
    _, drafter = build(spec, weights, False)
    graph = SimpleNamespace(tap_names=("layer_out.0", "final_norm"))
    with pytest.raises(BundleError, match="layer_out.2.*--taps final_norm layer_out.0 layer_out.2"):
        check_taps(graph, drafter, "onnx", "build/bundles/x")
    check_taps(SimpleNamespace(), drafter, "numpy_ref", "x")  # the numpy reference gives every tap


# -- exactness under sampling ---------------------------------------------------------------------------


class MarginalQ(DFlashDrafter):
    """WRONG, power control: draws the same walk, but hands the verifier each slot's MARGINAL (the walk's law
    of slot t summed over its predecessors) instead of the conditional q_t(. | drafted t-1) it drew from.
    (A one-hot q for the drawn token would be no control: verifying a draw x ~ q as a point mass, accept with
    p(x) else the residual of p without x, emits p exactly, so that test could not fail.)"""

    def propose(self, ctx):
        tree = super().propose(ctx)
        if tree.q is None or self.last_walk is None:
            return tree
        marginal = None
        for t, (cands, cond) in enumerate(self.last_walk):
            marginal = cond[0] if marginal is None else marginal @ cond
            q = np.zeros(tree.q.shape[1])
            q[cands] = marginal
            tree.q[t] = q
        return tree


def session(spec, weights, drafter_cls):
    # selector weights ~0.45: pair terms of order 1, so the walk's conditional q really depends on its predecessor
    tgt, drafter = build(spec, weights, True, layers=1, block=3, top_k=4, selector_scale=0.45, drafter_cls=drafter_cls,
                         sampled_walk=True)
    return SimpleNamespace(engine=Engine(tgt, drafter, eos_ids=()), drafter=drafter, target=tgt, tokenizer=None)


# The two of six random prompts (numpy seed 11) where the control showed most in a one-off search (700 draws each,
# control pair p-values 2e-19 and 1e-12; the other four ranged 0.04..0.24): the real walk is tested where a wrong
# q would show.
CONTEXTS = [("prompt a", [69, 2, 47, 14, 38, 90]), ("prompt b", [95, 60, 84, 35, 14, 49])]
# Four allowed tokens (the same mask on p and q, as action tokens use): drafts are often accepted, so the
# second emitted token often comes from the walk's second slot, where the conditional q matters.
PARAMS = SamplingParams(temperature=1.0, allowed_tokens=tuple(range(10, 14)))


# T = 0.6 as well: the walk divides the pair term by the temperature, a path T = 1 leaves untested (measured at
# 800 draws: the walk's p-values 0.62..0.90, the control's pair p-values 5e-10 and 2e-4).
TEMPERATURES = pytest.mark.parametrize("temperature", [1.0, 0.6], ids=["T1", "T0.6"])


@TEMPERATURES
def test_dflash2_sampled_walk_keeps_the_first_two_tokens_law(target, temperature):
    spec, weights = target
    params = replace(PARAMS, temperature=temperature)
    results = certify(session(spec, weights, DFlashDrafter), CONTEXTS, params, draws=DRAWS, alpha=ALPHA, seed=1)
    for res in results:
        assert res.passed, res
        assert res.tau > 1.0  # drafts were really proposed and partly accepted


@TEMPERATURES
def test_control_handing_the_slot_marginal_instead_of_the_walk_q_is_rejected(target, temperature):
    spec, weights = target
    params = replace(PARAMS, temperature=temperature)
    results = certify(session(spec, weights, MarginalQ), CONTEXTS, params, draws=DRAWS, alpha=ALPHA, seed=2)
    assert any(not r.passed for r in results), results


def test_bundle_carries_dflash_drafters_to_a_session_with_greedy_identity(tmp_path):
    """`edgespec bundle --dflash DIR` (build_bundle) -> bundle.yaml -> Session: both kinds load, and greedy
    decoding with them equals plain decoding."""
    from export.bundle.builder import build_bundle
    from runtime.model import bundle as bundle_io
    from runtime.serving.session import GenerationParams, Session
    from tests.support.tiny_bundle import make_tokenizer, save_random_llama

    tok = str(tmp_path / "tokenizer.json")
    vocab = make_tokenizer(tok)
    save_random_llama(str(tmp_path / "target"), vocab, 3, H, 0, tok)
    dirs = []
    for v2 in (False, True):
        cfg = dict(official_config(v2), vocab_size=vocab, num_target_layers=3)
        w = official_weights(v2)
        for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
            if name in w:
                w[name] = np.random.default_rng(1).standard_normal((vocab, 8)).astype(np.float32) * 0.3
        cfg["dflash_config"]["mask_token_id"] = 3
        dirs.append(write_checkpoint(str(tmp_path / ("dflash2" if v2 else "dflash")), cfg, w))
    out = build_bundle(str(tmp_path / "target"), str(tmp_path / "bundle"), dflash_dirs=dirs)
    b = bundle_io.load(out)
    assert b.drafters["dflash"].kind == "dflash" and b.drafters["dflash2"].kind == "dflash2"
    assert b.drafters["dflash2"].target_taps == ("layer_out.0", "layer_out.2")
    from runtime.memory import plan as memory
    for kind in ("dflash", "dflash2"):  # the memory plan counts the drafter's own tensors, not a second embedding
        inp = registry.plan_inputs(b, kind, "numpy_ref", 5)
        numel = sum(v.size for v in read_dflash_checkpoint(dirs[kind == "dflash2"]).weights.values())
        assert sum(memory.drafter_weight_bytes(inp)) + inp.drafter_extra_bytes == 4 * numel
    params = GenerationParams(max_tokens=20)
    plain = Session.open(out, drafter="none", backend="numpy_ref").generate("open the drawer", params).token_ids
    for kind in ("dflash", "dflash2"):
        res = Session.open(out, drafter=kind, backend="numpy_ref").generate("open the drawer", params)
        assert res.token_ids == plain and res.stats.drafter == kind


def reference_logits(w, cfg, feats, anchor_emb, mask_emb, ctx_pos, anchor_pos, head, v2):
    """The official forward in torch, all context at once (z-lab DFlashDraftModel / DFlash-2 decoder layer):
    context = hidden_norm(fc(feats)) projected by k/v_proj without input_layernorm; local mixing (DFlash-2)
    around attention and MLP with the kernel projected from the normed sublayer input."""
    import torch

    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
    eps, d, nh, nkv = cfg["rms_norm_eps"], HEAD_DIM, HEADS, KV_HEADS
    block = cfg["block_size"]
    group = cfg["dflash_config"].get("conv_group_size", 1)

    def norm(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * g

    def rope(x, pos):
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def conv(x, dyn, base):  # x (B, H), dyn (B, 2 taps, G), base (2 taps, H)
        k = base[None] + dyn.repeat_interleave(group, -1)
        prev = torch.cat([torch.zeros_like(x[:1]), x[:-1]])
        return k[:, 0] * x + k[:, 1] * prev

    c = norm(torch.tensor(feats, dtype=torch.float64) @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = torch.tensor(np.stack([anchor_emb] + [mask_emb] * (block - 1)), dtype=torch.float64)
    bpos = list(range(anchor_pos, anchor_pos + block))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        if v2:
            dyn = (h @ t[p + "attention_conv.kernel_projection.weight"].T).view(block, 2, 2, -1)
            h = conv(h, dyn[:, 0], t[p + "attention_conv.base_kernel"][0])
        q = rope(norm((h @ t[p + "self_attn.q_proj.weight"].T).view(block, nh, d), t[p + "self_attn.q_norm.weight"]), bpos)
        kin = torch.cat([c, h])
        k = rope(norm((kin @ t[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d), t[p + "self_attn.k_norm.weight"]),
                 list(ctx_pos) + bpos)
        v = (kin @ t[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(block, -1) @ t[p + "self_attn.o_proj.weight"].T
        x = x + (conv(o, dyn[:, 1], t[p + "attention_conv.base_kernel"][1]) if v2 else o)
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        if v2:
            dyn = (h @ t[p + "mlp_conv.kernel_projection.weight"].T).view(block, 2, 2, -1)
            h = conv(h, dyn[:, 0], t[p + "mlp_conv.base_kernel"][0])
        m = (torch.nn.functional.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
        x = x + (conv(m, dyn[:, 1], t[p + "mlp_conv.base_kernel"][1]) if v2 else m)
    return (norm(x[1:], t["norm.weight"]) @ torch.tensor(head, dtype=torch.float64).T).numpy()


@pytest.mark.parametrize("v2", [False, True], ids=["dflash", "dflash2"])
def test_numpy_drafter_equals_the_official_forward_across_cycles(target, v2):
    """Cycle 1 caches the prompt's context rows; cycle 2 adds the committed rows: its logits equal the official
    forward over the whole context at once (so the cache holds exactly the context K/V, at the right positions)."""
    spec, weights = target
    tgt, drafter = build(spec, weights, v2, block=5)
    cfg, w = official_config(v2, block=5), official_weights(v2)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    res = tgt.forward(np.asarray(prompt), np.arange(len(prompt)), taps=drafter.target_taps)
    drafter.begin(prompt, res.taps)
    drafter.forward(79, len(prompt), 5)  # cycle 1: anchor 79 after the prompt
    more = tgt.forward(np.asarray([79, 32]), np.arange(len(prompt), len(prompt) + 2), taps=drafter.target_taps)
    drafter.accept([0], [79, 32], more.taps)  # committed: the anchor and one accepted draft
    _, logits = drafter.forward(38, len(prompt) + 2, 5)  # cycle 2: the next anchor
    feats = np.concatenate([np.concatenate([res.taps[k], more.taps[k]]) for k in drafter.target_taps], axis=-1)
    embed = tgt.w["model.embed_tokens.weight"]
    ref = reference_logits(w, cfg, feats, embed[38], embed[V - 1], range(len(prompt) + 2), len(prompt) + 2,
                           tgt.lm_head, v2)
    np.testing.assert_allclose(logits, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("v2", [False, True], ids=["dflash", "dflash2_marginals"])
def test_dflash_sampled_block_keeps_the_first_two_tokens_law_and_a_wrong_residual_is_caught(target, v2):
    """DFlash, and DFlash-2 by default (`sampled_walk: false`), draw each slot from its own q (the slots are
    independent given the context): the real verifier keeps the law; the same run verified by `forget_residual`
    (p instead of norm(max(0, p - q)) after a rejection) is rejected by the same test."""
    from runtime.certify.run import forget_residual

    spec, weights = target
    tgt, drafter = build(spec, weights, v2, layers=1, block=3)
    sess = SimpleNamespace(engine=Engine(tgt, drafter, eos_ids=()), drafter=drafter, target=tgt, tokenizer=None)
    good = certify(sess, CONTEXTS[:1], PARAMS, draws=DRAWS, alpha=ALPHA, seed=3)
    assert all(r.passed and r.tau > 1.0 for r in good), good
    bad = certify(sess, CONTEXTS[:1], PARAMS, draws=DRAWS, alpha=ALPHA, seed=4, verifier=forget_residual)
    assert not bad[0].passed, bad
