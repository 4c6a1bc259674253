"""The MTP drafter (DeepSeek-V3 layout) in numpy equals the torch module it was trained as, and
speculative decoding with it stays token-identical to plain greedy decoding."""
import numpy as np
import pytest
import torch

from export.zoo.model import LlamaConfig, LlamaLM, hf_state_dict
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.base import DraftContext
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.decode.engine import Engine
from runtime.memory.kv import KVArena
from runtime.model.spec import ModelSpec
from runtime.sampling import SamplingParams
from tests.support.hf_tiny import rel_err


@pytest.fixture(scope="module")
def mtp_model():
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = LlamaLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    weights = {k: v.detach().numpy().copy() for k, v in hf_state_dict(model).items()}
    return model, ModelSpec.from_hf_config(cfg.hf_dict()), weights


def build(spec, weights, k=3, positions=128):
    arena = KVArena.for_context({"t": cache_shape(spec), "m": mtp_cache_shape(spec)}, positions + 8)
    target = NumpyTarget(spec, weights, arena.allocate("t", cache_shape(spec), positions))
    embed = target.w["model.embed_tokens.weight"]
    drafter = MTPDrafter(spec, weights, embed, embed, arena.allocate("m", mtp_cache_shape(spec), positions + 8), k)
    return target, drafter


def test_mtp_first_draft_distribution_equals_the_torch_module(mtp_model):
    model, spec, weights = mtp_model
    ids = [5, 9, 17, 3, 44, 8, 2, 60]
    with torch.no_grad():
        _, h = model(torch.tensor([ids]))
        ref = model.mtp_logits(h[:, :-1], torch.tensor([ids[1:]]))[0, -1].numpy()  # predicts the token after ids[-1]+1
    target, drafter = build(spec, weights, k=1)
    res = target.forward(np.array(ids[:-1]), np.arange(len(ids) - 1), taps=drafter.target_taps)
    drafter.begin(ids[:-1], res.taps)
    tree = drafter.propose(DraftContext(ids, SamplingParams(temperature=1.0), np.random.default_rng(0), 8))
    q = tree.q[0]
    ref_q = np.exp(ref - ref.max())
    ref_q /= ref_q.sum()
    assert rel_err(q, ref_q) <= 1e-4


def test_greedy_decoding_with_mtp_is_token_identical_to_plain(mtp_model):
    _, spec, weights = mtp_model
    rng = np.random.default_rng(3)
    for i in range(20):
        prompt = list(rng.integers(0, spec.vocab_size, 8))
        target, _ = build(spec, weights)
        plain = Engine(target, None).generate(prompt, SamplingParams(), 24).tokens
        target, drafter = build(spec, weights, k=3)
        out = Engine(target, drafter).generate(prompt, SamplingParams(), 24)
        assert out.tokens == plain
