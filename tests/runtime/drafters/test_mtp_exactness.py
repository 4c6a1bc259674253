"""Sampled MTP chains, drafted by the real MTPDrafter (its own sampling and its own recorded q) through the real
engine and verifier, keep the target's law of the first emitted token and of the first two: with two modules
(depth 2 drafted by module 1 on module 0's output), with one module reused autoregressively (depth 2 drafted by
module 0 again on its own output), at T = 1 and at a peaked T = 0.5 where q and p differ most.

Statistical tests: alpha = 0.001, DRAWS draws per configuration, fixed seeds (weights, context search, draws).
The models: a tiny random numpy Llama with two DeepSeek-V3 MTP modules (tests/support/mtp_tiny.py) and a vocabulary of
V = 16, so that the first-two-token law has few enough outcomes (16 x 16) for 500 draws to fill its bins; the
pair test is where a mistake at depth 2 shows. One context per configuration, searched deterministically over 32
random prompts for where its power control's expected chi-square per draw (a Monte Carlo estimate, used only to
rank prompts) is largest, as `edgespec certify` does. Power controls, each of which the same test must reject:
  - at T = 0.5, `previous_depths_q`: the drafter records for its depth-2 token the q of depth 1 (an MTP runtime
    that pairs a module's token with another module's proposal). Depth 1 stays right, so only the pair law can
    catch it: it shows that the test sees the second module, and the reused one;
  - at T = 1, `forget_residual`: after a rejection, the correction is drawn from p instead of the residual."""
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify, forget_residual, memoise_session, run_until, sensitivity
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.decode.engine import Engine
from runtime.memory.kv import KVArena
from runtime.model.spec import ModelSpec
from runtime.sampling import SamplingParams
from runtime.verify import residual
from tests.support.mtp_tiny import mtp_weights

ALPHA = 1e-3
DRAWS = 500
VOCAB = 16


@pytest.fixture(scope="module")
def weights():
    w = mtp_weights(VOCAB, modules=2, seed=1)
    return ModelSpec.from_hf_config(w.pop("config")), w


def mtp_session(spec, w, modules, k, positions=96):
    """The real engine with a NumpyTarget and an MTPDrafter over the first `modules` modules, drafting k tokens."""
    shapes = {"t": cache_shape(spec), **{f"m{i}": mtp_cache_shape(spec) for i in range(modules)}}
    arena = KVArena.for_context(shapes, positions + k)
    target = NumpyTarget(spec, w, arena.allocate("t", cache_shape(spec), positions))
    embed = target.w["model.embed_tokens.weight"]
    caches = [arena.allocate(f"m{i}", mtp_cache_shape(spec), positions + k) for i in range(modules)]
    drafter = MTPDrafter(spec, w, embed, embed, caches, k)
    return SimpleNamespace(engine=Engine(target, drafter, eos_ids=()), drafter=drafter, target=target, tokenizer=None)


def previous_depths_q(drafter):
    """WRONG, for the power control: the drafter's chains with depth j >= 2 recording the q of depth j - 1."""
    real = drafter.propose

    def propose(ctx):
        tree = real(ctx)
        if tree.q is not None and len(tree) > 1:
            tree.q = np.concatenate([tree.q[:1], tree.q[:-1]])
        return tree

    drafter.propose = propose


def wrong_q_bias(p, q_drawn, q_recorded):
    """law - p of the token emitted at a node whose draft was drawn from q_drawn but verified against q_recorded:
    accept x with min(1, p(x)/q_recorded(x)), else draw from norm(max(0, p - q_recorded))."""
    law = q_drawn * np.minimum(1.0, p / q_recorded)
    return law + (1.0 - law.sum()) * residual(p, q_recorded) - p


def control_power(session, target, prompt, params, control, chains=6):
    """The control's expected chi-square per draw, by Monte Carlo over the drafter's own first chains (seeds
    0..chains-1). "forget_residual": certify's closed form at depth 1. "previous_depths_q": the pair law's,
    sum over x1 of min(p1, q1)(x1)^2 / p1(x1) * sum_t2 bias(t2 | x1)^2 / p2(t2 | x1) (depth 1 is right, so the
    pair's bias is P(x1 drafted and accepted) times the depth-2 bias), each chain's x1 weighted by 1 / q1(x1)."""
    root = int(np.argmax(target.distribution(prompt, SamplingParams())))
    p1 = target.distribution(list(prompt) + [root], params)
    trees = []
    real = session.drafter.propose
    session.drafter.propose = lambda ctx: trees.append(real(ctx)) or trees[-1]
    try:
        scores = []
        for seed in range(chains):
            trees.clear()
            run_until(session.engine, prompt, params, seed, root, 2)
            q = trees[0].q
            if control == "forget_residual":
                scores.append(sensitivity(p1, q[0], 1))
                continue
            x1 = int(trees[0].tokens[0])
            p2 = target.distribution(list(prompt) + [root, x1], params)
            bias = wrong_q_bias(p2, q[1], q[0])
            scores.append(min(p1[x1], q[0][x1]) ** 2 / (p1[x1] * q[0][x1]) * float((bias ** 2 / p2).sum()))
    finally:
        del session.drafter.propose
    return float(np.mean(scores))


def most_sensitive_prompt(session, spec, params, control, candidates=32):
    target = memoise_session(session)
    rng = np.random.default_rng(123)
    scored = []
    for i in range(candidates):
        prompt = [int(t) for t in rng.integers(0, spec.vocab_size, 8)]
        scored.append((control_power(session, target, prompt, params, control), i, prompt))
    score, i, prompt = max(scored)
    return [(f"prompt {i} (control score {score:.2f})", prompt)]


# (label, modules, tokens drafted, temperature, power control)
CONFIGS = [("two modules, T=0.5", 2, 2, 0.5, "previous_depths_q"),
           ("one module reused, T=0.5", 1, 2, 0.5, "previous_depths_q"),
           ("two modules + reuse at depth 3, T=1", 2, 3, 1.0, "forget_residual")]


@pytest.mark.parametrize("label,modules,k,temperature,control", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_sampled_mtp_chains_keep_the_first_two_tokens_law_and_the_control_is_rejected(weights, label, modules, k,
                                                                                        temperature, control):
    spec, w = weights
    params = SamplingParams(temperature=temperature)
    contexts = most_sensitive_prompt(mtp_session(spec, w, modules, k), spec, params, control)

    (res,) = certify(mtp_session(spec, w, modules, k), contexts, params, draws=DRAWS, alpha=ALPHA, seed=1)
    assert res.passed, res
    assert res.tau > 1.2, res  # drafts were made and accepted, depth 2 reached often

    wrong = mtp_session(spec, w, modules, k)
    if control == "previous_depths_q":
        previous_depths_q(wrong.drafter)
        (bad,) = certify(wrong, contexts, params, draws=DRAWS, alpha=ALPHA, seed=2)
        assert bad.first_p_value >= ALPHA and bad.pair_p_value < ALPHA, bad  # depth 1 right, depth 2 caught
    else:
        (bad,) = certify(wrong, contexts, params, draws=DRAWS, alpha=ALPHA, seed=2, verifier=forget_residual)
        assert not bad.passed, bad
