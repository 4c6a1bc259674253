"""Sampled draft TREES through the real engine and the real DraftModelDrafter (its own sibling sampling, not a
hand-built tree) keep the target's distribution of the first emitted token and of the first two; the
duplicate-dropping rule of issue 10, swapped into the same drafter, is rejected by the same test.

alpha = 0.001; DRAWS draws per context; fixed seeds. The models are tiny random numpy Llamas (V = 97): a
target, and a drafter that is the target with noise and three times sharper logits — q peaked and unlike p,
where a wrong sibling rule shows. Contexts are searched deterministically over random prompts by
`runtime.certify.run.sensitivity` (the control's expected chi-square per draw), as `edgespec certify` does.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify, dedup_siblings, first_proposal, memoise_session, sensitivity
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.decode.engine import Engine
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams
from tests.support.hf_tiny import tiny_hf_model

ALPHA = 1e-3
DRAWS = 6000
PARAMS = SamplingParams(temperature=1.0)


def overconfident(weights, noise=0.5, sharpen=3.0, seed=0):
    """The target's weights plus noise, with the final norm (hence every logit) scaled by `sharpen`."""
    rng = np.random.default_rng(seed)
    out = {k: v + noise * rng.standard_normal(v.shape).astype(np.float32) * np.abs(v).mean() for k, v in weights.items()}
    out["model.norm.weight"] = out["model.norm.weight"] * sharpen
    return out


def tree_session(branching: int):
    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=2)
    shapes = {"target": cache_shape(spec), "draft": cache_shape(spec)}
    arena = KVArena.for_context(shapes, 96)
    target = NumpyTarget(spec, weights, arena.allocate("target", shapes["target"], 96))
    draft = NumpyTarget(spec, overconfident(weights), arena.allocate("draft", shapes["draft"], 96))
    drafter = DraftModelDrafter(draft, num_tokens=3, branching=branching)
    engine = Engine(target, drafter, eos_ids=())
    return SimpleNamespace(engine=engine, drafter=drafter, target=target, tokenizer=None), spec


def most_sensitive_prompts(session, spec, n_candidates=48, keep=2):
    target = memoise_session(session)
    rng = np.random.default_rng(123)
    scored = []
    for i in range(n_candidates):
        prompt = [int(t) for t in rng.integers(0, spec.vocab_size, 8)]
        p, q = first_proposal(session, target, prompt, PARAMS)
        scored.append((sensitivity(p, q, session.drafter.branching), i, prompt))
    scored.sort(reverse=True)
    return [(f"prompt {i} (control chi2/draw {s:.3f})", prompt) for s, i, prompt in scored[:keep]]


@pytest.fixture(scope="module", params=[2, 3], ids=["branching2", "branching3"])
def searched(request):
    session, spec = tree_session(request.param)
    return session, most_sensitive_prompts(session, spec)


def test_searched_contexts_are_where_a_wrong_sibling_rule_shows(searched):
    session, contexts = searched
    # expected control chi-square over DRAWS draws well above the dof of the test
    assert all(float(label.split("draw ")[1].rstrip(")")) * DRAWS > 40 for label, _ in contexts), contexts


def test_sampled_trees_from_the_real_drafter_keep_the_first_two_tokens_law(searched):
    session, contexts = searched
    for res in certify(session, contexts, PARAMS, draws=DRAWS, alpha=ALPHA, seed=1):
        assert res.passed, res
        assert res.tau > 1.0  # the trees were really drafted and partly accepted


def test_control_the_duplicate_dropping_sibling_rule_is_rejected(searched):
    session, contexts = searched
    results = certify(session, contexts, PARAMS, draws=DRAWS, alpha=ALPHA, seed=2, sibling_rule=dedup_siblings)
    assert any(not r.passed for r in results), results
    assert session.drafter.sibling_rule is not dedup_siblings  # certify put the right rule back
