"""The Medusa drafter: trees from choice lists, greedy output token-identical to plain decoding (with the heads
shipped in zoo/medusa on the zoo target, chain and tree), and sampled chains and trees drawn by the drafter
itself keeping the target's law of the first emitted token and of the first two.

Statistical tests: alpha = 0.001, DRAWS[kind] draws per context (chain 1500, tree 6000: each enough for its
power control's expected chi-square to exceed 40), fixed seeds; contexts searched deterministically
over random prompts by `runtime.certify.run.sensitivity` (the power control's expected chi-square per draw).
The models are a tiny random numpy Llama (V = 97) and Medusa heads made from its own LM head with noise and
three times sharper logits (q peaked and unlike p, where a wrong rule shows). Power controls: the
duplicate-dropping sibling rule (trees) and a verifier that forgets the residual (chains) must be rejected."""
from tests.support import REPO_ROOT
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from export.bundle.hf_reader import read_hf_checkpoint
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify, dedup_siblings, first_proposal, forget_residual, memoise_session, sensitivity
from runtime.drafters.base import DraftContext
from runtime.drafters.medusa import MedusaDrafter, resolve_tree, standard_trees
from runtime.decode.engine import Engine
from runtime.memory.kv import KVArena
from runtime.text.prompts import planner_prompt
from runtime.sampling import SamplingParams
from runtime.siblings import without_replacement
from runtime.model.tensors import read_safetensors
from runtime.text.tokenizer import Tokenizer
from runtime.tree import from_choices
from tests.support.hf_tiny import tiny_hf_model

ALPHA = 1e-3
DRAWS = {"chain": 1500, "tree": 6000}
PARAMS = SamplingParams(temperature=1.0)
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
REPO = REPO_ROOT


def tiny_heads(spec, weights, num_heads=3, sharpen=3.0, noise=0.5, seed=0):
    """Medusa heads in the official layout: head k = (its ResBlock) + the target's LM head, noisy and sharp."""
    rng = np.random.default_rng(seed)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    H = spec.hidden_size
    w = {}
    for k in range(num_heads):
        w[f"{k}.0.linear.weight"] = (0.1 * rng.standard_normal((H, H))).astype(np.float32)
        w[f"{k}.0.linear.bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
        w[f"{k}.1.weight"] = (sharpen * (head + noise * np.abs(head).mean() * rng.standard_normal(head.shape))).astype(np.float32)
    return w


def tiny_session(tree, num_tokens=3):
    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=2)
    arena = KVArena.for_context({"target": cache_shape(spec)}, 96)
    target = NumpyTarget(spec, weights, arena.allocate("target", cache_shape(spec), 96))
    drafter = MedusaDrafter(tiny_heads(spec, weights), tree=tree, num_tokens=num_tokens)
    engine = Engine(target, drafter, eos_ids=())
    return SimpleNamespace(engine=engine, drafter=drafter, target=target, tokenizer=None), spec


def begun(session, prompt):
    res = session.target.forward(np.asarray(prompt), np.arange(len(prompt)), None, session.drafter.target_taps)
    session.drafter.begin(prompt, res.taps)
    return res


# ---- trees ------------------------------------------------------------------------------------------------------

def test_shipped_choice_lists_are_valid_trees():
    trees = standard_trees()
    assert {"mc_sim_7b_63", "vicuna_7b_stage2"} <= set(trees)
    for name, choices in trees.items():
        cands = [np.arange(20) for _ in range(max(map(len, choices)))]
        from_choices(choices, cands).validate()
    assert resolve_tree("mc_sim_7b_63", 2) == [p for p in sorted(trees["mc_sim_7b_63"], key=lambda p: (len(p), p))
                                               if len(p) <= 2]
    assert resolve_tree("chain", 3) == [(0,), (0, 0), (0, 0, 0)]


def test_greedy_tree_is_the_choice_list_filled_with_each_heads_top_k():
    session, spec = tiny_session(TREE)
    prompt = [5, 9, 17, 3, 44]
    res = begun(session, prompt)
    d = session.drafter
    tree = d.propose(DraftContext(prompt + [7], SamplingParams(), np.random.default_rng(0), 64))
    logits = d.head_logits(res.taps["final_norm"][-1], 3)
    want = from_choices(TREE, [np.argsort(-row, kind="stable")[:3] for row in logits])
    assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents.tolist() == want.parents.tolist()
    assert tree.deterministic.all()
    cut = d.propose(DraftContext(prompt + [7], SamplingParams(), np.random.default_rng(0), 4))
    assert cut.tokens.tolist() == want.tokens[:4].tolist()  # max_nodes keeps a prefix: parents before children


def test_sampled_tree_children_are_drawn_by_the_sibling_rule_with_their_proposals():
    session, spec = tiny_session(TREE)
    prompt = [5, 9, 17, 3, 44]
    begun(session, prompt)
    d = session.drafter
    calls = []

    def rule(q, width, rng, exclude=()):
        calls.append(width)
        return without_replacement(q, width, rng, exclude)

    d.sibling_rule = rule
    tree = d.propose(DraftContext(prompt + [7], PARAMS, np.random.default_rng(1), 64))
    tree.validate()
    assert not tree.deterministic.any() and len(tree) == len(TREE)
    assert sorted(calls) == [1, 1, 2, 2]  # root: 2 children; [0]: 2; [1]: 1; [0, 0]: 1
    root_kids = tree.children(-1)
    assert tree.q[root_kids[1]][tree.tokens[root_kids[0]]] == 0.0  # the second sibling excludes the first


# ---- greedy identity ----------------------------------------------------------------------------------------------

def test_greedy_decoding_with_tiny_heads_is_token_identical_to_plain():
    for tree in ("chain", TREE):
        session, spec = tiny_session(tree)
        plain = Engine(session.target, None)
        rng = np.random.default_rng(5)
        for i in range(6):
            prompt = [int(t) for t in rng.integers(0, spec.vocab_size, 6)]
            want = plain.generate(prompt, SamplingParams(), 24).tokens
            got = session.engine.generate(prompt, SamplingParams(), 24)
            assert got.tokens == want, (tree, i)


@pytest.fixture(scope="module")
def zoo():
    target = read_hf_checkpoint(os.path.join(REPO, "zoo", "target"))
    heads = read_safetensors(os.path.join(REPO, "zoo", "medusa", "medusa_lm_head.safetensors"))
    tok = Tokenizer(os.path.join(REPO, "zoo", "target", "tokenizer.json"))
    return target, heads, tok


def test_greedy_decoding_with_the_shipped_zoo_heads_is_token_identical_to_plain(zoo):
    ckpt, heads, tok = zoo
    spec = ckpt.spec
    arena = KVArena.for_context({"target": cache_shape(spec)}, 160)
    target = NumpyTarget(spec, ckpt.weights, arena.allocate("target", cache_shape(spec), 160))
    ids = tok.encode(planner_prompt("take the white hammer from the bathroom to Eve in the kitchen"))
    want = Engine(target, None).generate(ids, SamplingParams(), 24).tokens
    with open(os.path.join(REPO, "zoo", "medusa", "config.json")) as f:
        tuned = json.load(f)["medusa_choices"]
    for tree in ("chain", tuned):
        drafter = MedusaDrafter(heads, tree, num_tokens=4, hidden=spec.hidden_size, vocab=spec.vocab_size)
        got = Engine(target, drafter).generate(ids, SamplingParams(), 24)
        assert got.tokens == want, tree
        assert got.stats.tau > 1.5, got.stats.tau  # the trained heads are accepted (measured: chain 2.1, tree 2.5)


# ---- the target's law under sampling ------------------------------------------------------------------------------

def most_sensitive_prompts(session, spec, n_candidates=96, keep=1):
    target = memoise_session(session)
    rng = np.random.default_rng(123)
    scored = []
    for i in range(n_candidates):
        prompt = [int(t) for t in rng.integers(0, spec.vocab_size, 8)]
        p, q = first_proposal(session, target, prompt, PARAMS)
        scored.append((sensitivity(p, q, session.drafter.branching), i, prompt))
    scored.sort(reverse=True)
    return [(f"prompt {i} (control chi2/draw {s:.3f})", prompt) for s, i, prompt in scored[:keep]]


@pytest.fixture(scope="module", params=["chain", "tree"])
def searched(request):
    session, spec = tiny_session("chain" if request.param == "chain" else TREE)
    contexts = most_sensitive_prompts(session, spec)
    assert all(float(label.split("draw ")[1].rstrip(")")) * DRAWS[request.param] > 40 for label, _ in contexts), contexts
    return request.param, session, contexts


def test_sampled_medusa_chains_and_trees_keep_the_first_two_tokens_law(searched):
    kind, session, contexts = searched
    for res in certify(session, contexts, PARAMS, draws=DRAWS[kind], alpha=ALPHA, seed=1):
        assert res.passed, res
        assert res.tau > 1.0  # drafts were really made and partly accepted


def test_control_a_wrong_rule_is_rejected(searched):
    kind, session, contexts = searched
    wrong = {"sibling_rule": dedup_siblings} if kind == "tree" else {"verifier": forget_residual}
    results = certify(session, contexts, PARAMS, draws=DRAWS[kind], alpha=ALPHA, seed=2, **wrong)
    assert any(not r.passed for r in results), results
