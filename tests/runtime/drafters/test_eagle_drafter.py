"""The EAGLE drafters (EAGLE-1 chains, EAGLE-2 dynamic trees, EAGLE-3 with a reduced vocabulary) through the
real engine: greedy output is token-identical to plain decoding; the drafter runs only newly committed
positions; sampled decoding keeps the target's law of the first and first two tokens (chi-square, alpha
0.001, DRAWS draws per context, fixed seeds) for chains, dynamic trees and split chains, and the same test
rejects a wrong rule swapped in (power control: a verifier that forgets the residual after a rejection). EAGLE-1
and EAGLE-3 dynamic trees are also certified at T = 0.8 (p and q both reshaped by the temperature), with a
wrong acceptance rule as the control (the top-k picks verified as if drawn from q). Heads are random
official-layout checkpoints (tests/support/eagle_tiny.py) on a tiny random target (V = 97): acceptance is low, so
rejections, where a wrong rule shows, are common."""
from types import SimpleNamespace

import numpy as np
import pytest

from export.drafters.eagle import load_eagle
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify, first_proposal, forget_residual, memoise_session, sensitivity
from runtime.drafters.eagle import UNMAPPED, DynamicTree, EagleDrafter, dynamic_tree
from runtime.decode.engine import Engine
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams
from runtime.speculation import Calibration, CostModel, NodeRule
from runtime.tree import DraftTree
from tests.support.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint
from tests.support.hf_tiny import tiny_hf_model

ALPHA = 1e-3
DRAWS = 1000
T1 = SamplingParams(temperature=1.0)
TREE = DynamicTree(total_tokens=8, depth=3, top_k=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=3)
    d = tmp_path_factory.mktemp("eagle")
    heads = {"eagle": load_eagle(eagle1_checkpoint(str(d / "e1"), spec, seed=1), spec),
             "eagle3": load_eagle(eagle3_checkpoint(str(d / "e3"), spec, seed=2, draft_vocab=60), spec)}
    return spec, weights, heads


def session(model, kind, tree=None, branching=1, num_tokens=3, sharpen=1.0):
    """`sharpen` scales the drafter's logits (its LM head / final norm): q peaked and unlike p, where a wrong
    rule shows most (the target is untouched)."""
    spec, weights, heads = model
    head = heads[kind]
    w = dict(head.weights)
    target_head = weights["lm_head.weight"]
    if kind == "eagle":
        target_head = target_head * np.float32(sharpen)
    else:
        w["norm.weight"] = w["norm.weight"] * np.float32(sharpen)
    shapes = {"target": cache_shape(spec), "draft": cache_shape(head.spec)}
    arena = KVArena.for_context(shapes, 128 + 64)
    target = NumpyTarget(spec, weights, arena.allocate("target", shapes["target"], 128))
    drafter = EagleDrafter(head.kind, head.spec, w, weights["model.embed_tokens.weight"], target_head, arena.allocate("draft", shapes["draft"], 128 + 64),
                           head.params, num_tokens=num_tokens, branching=branching, tree=tree)
    return SimpleNamespace(engine=Engine(target, drafter, eos_ids=()), drafter=drafter, target=target, tokenizer=None)


MODES = {"eagle1_chain": ("eagle", None, 1), "eagle2_tree": ("eagle", TREE, 1), "eagle1_split_chains": ("eagle", None, 2),
         "eagle3_chain": ("eagle3", None, 1), "eagle3_tree": ("eagle3", TREE, 1)}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_output_is_token_identical_to_plain_decoding(model, mode):
    kind, tree, branching = MODES[mode]
    s = session(model, kind, tree, branching)
    plain = Engine(s.target, None)
    trees = []
    propose = s.drafter.propose
    s.drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    # the first cycle's draft, full size: the dynamic tree's total_tokens, else branching chains of num_tokens 3
    full = TREE.total_tokens if tree is not None else 3 * branching
    for prompt in ([5, 6, 7, 8, 9], [1, 40, 2, 40, 2, 40], [90]):
        trees.clear()
        want = plain.generate(prompt, SamplingParams(), 40).tokens
        out = s.engine.generate(prompt, SamplingParams(), 40)
        assert out.tokens == want
        # identity was tested against real drafts (an empty draft is plain decoding, trivially identical)
        assert len(trees[0]) == full


def test_drafter_runs_only_the_newly_committed_positions(model):
    s = session(model, "eagle3", TREE)
    drafter = s.drafter
    seen = []
    run = drafter._catch_up

    def catch_up(tokens):
        before = drafter.committed_rows
        out = run(tokens)
        seen.append((len(tokens), before, drafter.committed_rows))
        return out

    drafter._catch_up = catch_up
    s.engine.generate([5, 6, 7, 8, 9], T1, 30, seed=4)
    prev_len = None
    for n_tokens, before, after in seen:
        assert after == n_tokens - 1  # every committed position but the root has its row, computed once
        if prev_len is not None:
            assert after - before == n_tokens - prev_len  # only the tokens committed since the last cycle
        prev_len = n_tokens


def test_dynamic_tree_keeps_the_best_paths_parents_first():
    # The docstring's example: root children a=0 (-0.1), b=1 (-2.5); a -> c=2 (-0.2), d=3 (-3.0); b -> e=4, f=5.
    rows = {0: {2: -0.2, 3: -3.0}, 1: {4: -0.1, 5: -0.5}}

    def logp(d):
        out = np.full(8, -np.inf)
        for t, v in d.items():
            out[t] = v
        return out

    def expand(frontier, tokens, parents):
        return [logp(rows.get(tokens[n], {})) for n in frontier]

    tokens, parents, _ = dynamic_tree(expand, logp({0: -0.1, 1: -2.5}), DynamicTree(3, 2, 2), 100)
    assert (tokens, parents) == ([0, 1, 2], [-1, -1, 0])
    tokens, parents, _ = dynamic_tree(expand, logp({0: -0.1, 1: -2.5}), DynamicTree(60, 2, 2), 100)
    assert tokens == [0, 1, 2, 3, 4, 5] and parents == [-1, -1, 0, 0, 1, 1]
    assert dynamic_tree(expand, logp({0: -0.1, 1: -2.5}), DynamicTree(60, 2, 2), 4)[0] == [0, 1, 2, 4]


def test_a_dynamic_tree_of_a_small_budget_is_the_full_searchs_best_nodes_for_a_fraction_of_the_expansions():
    # A probe of 2 nodes (or any budget below top_k / depth) keeps exactly the best `budget` nodes of the full
    # search (top_k 4, depth 4), cut where they stop paying under a node rule, and expands only budget-wide levels.
    cal = Calibration(prior_weight=0.0)
    cal.observe([0.05, 0.25, 0.45, 0.55, 0.75, 0.97], [False, False, False, True, True, True])
    stop = NodeRule(CostModel(((1, 1.0), (2, 1.2))), cal, rate=1.5)
    shape = DynamicTree(total_tokens=60, depth=4, top_k=4)
    for seed in range(30):
        def row(path):  # the drafter's log-probabilities after a path: a function of the path only
            r = np.random.default_rng([seed, *path]).dirichlet(np.full(12, 0.3))
            with np.errstate(divide="ignore"):
                return np.log(r)
        runs = []

        def expand(frontier, tokens, parents):
            runs.append(len(frontier))
            return [row([tokens[a] for a in path_of(parents, n)]) for n in frontier]

        full = dynamic_tree(expand, row([]), shape, 100)
        ranked = sorted(range(len(full[0])), key=lambda n: (-full[2][n], n))
        for budget in (1, 2, 3):
            for rule in (None, stop):
                best = ranked[:budget]
                if rule is not None:
                    paying = [rule.pays(rule.fixed_gain(full[2][n]), i) for i, n in enumerate(best)]
                    best = best[:paying.index(False) if False in paying else len(best)]
                runs.clear()
                tokens, parents, _ = dynamic_tree(expand, row([]), shape, budget, rule)
                assert paths_of(tokens, parents) == paths_of(*full[:2], sorted(best)), (seed, budget, rule)
                assert len(runs) <= budget - 1 and all(r <= budget for r in runs)


def path_of(parents, n):
    out = []
    while n >= 0:
        out.append(n)
        n = parents[n]
    return out[::-1]


def paths_of(tokens, parents, nodes=None):
    """The set of token paths (root down) of the tree's nodes (or of `nodes` only)."""
    nodes = range(len(tokens)) if nodes is None else nodes
    return {tuple(tokens[a] for a in path_of(parents, n)) for n in nodes}


def test_dynamic_trees_respect_the_node_budget_and_order(model):
    s = session(model, "eagle", DynamicTree(total_tokens=10, depth=4, top_k=3))
    trees = []
    propose = s.drafter.propose
    s.drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    s.engine.generate([5, 6, 7], T1, 20, seed=1)
    assert trees and all(1 <= len(t) <= 10 for t in trees)
    for t in trees:
        t.validate()
        assert t.deterministic.all() and t.q is None  # point masses at T = 1 too
        assert int(t.depths().max()) <= 4


def test_reduced_vocabulary_logits_land_on_the_d2t_target_ids(model):
    s = session(model, "eagle3")
    d2t = model[2]["eagle3"].weights["d2t"]
    ids = np.arange(60) + d2t
    logits = s.drafter._logits(np.ones((1, 64), np.float32))[0]
    outside = np.setdiff1d(np.arange(97), ids)
    assert (logits[outside] == UNMAPPED).all() and (logits[ids] > UNMAPPED).all()


def searched_contexts(s, width, n_candidates=24, keep=1, params=T1):
    target = memoise_session(s)
    rng = np.random.default_rng(123)
    scored = []
    for i in range(n_candidates):
        prompt = [int(t) for t in rng.integers(0, 97, 8)]
        p, q = first_proposal(s, target, prompt, params)
        if q is not None:
            scored.append((sensitivity(p, q, width), i, prompt))
    scored.sort(reverse=True)
    return [(f"prompt {i} (control chi2/draw {sc:.3f})", prompt) for sc, i, prompt in scored[:keep]]


# Power control: a verifier that forgets the residual after a rejection. (The duplicate-dropping sibling rule
# is no control here: a random head's q rarely repeats a rejected token, so its bias is invisible at this
# sample count; tests/runtime/certify/test_certify_trees.py shows it on the same `sibling_rule` seam with a peaked draft.)
CERTIFIED = {"eagle3_chain": ("eagle3", None, 1), "eagle2_tree": ("eagle", TREE, 1),
             "eagle1_split_chains": ("eagle", None, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(CERTIFIED))
def test_sampled_drafts_keep_the_first_two_tokens_law_and_a_wrong_rule_is_rejected(model, mode):
    kind, tree, branching = CERTIFIED[mode]
    s = session(model, kind, tree, branching)
    contexts = searched_contexts(s, 1)
    assert float(contexts[0][0].split("draw ")[1].rstrip(")")) * DRAWS > 40  # the control is visible here
    for res in certify(s, contexts, T1, draws=DRAWS, alpha=ALPHA, seed=1):
        assert res.passed, res
        assert res.tau > 1.0  # drafts were made and sometimes accepted
    results = certify(s, contexts, T1, draws=DRAWS, alpha=ALPHA, seed=2, verifier=forget_residual)
    assert any(not r.passed for r in results), results


@pytest.mark.parametrize("mode", ["eagle1_chain", "eagle2_tree", "eagle3_tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_follow_the_requests_grammar_mask(model, mode, temperature):
    from runtime.drafters.base import DraftContext

    kind, tree, branching = MODES[mode]
    s = session(model, kind, tree, branching)
    allowed = np.zeros(97, bool)
    allowed[10:30] = True
    prompt = [5, 6, 7, 8, 9]
    res = s.target.forward(np.asarray(prompt), np.arange(5), None, s.drafter.target_taps)
    s.drafter.begin(prompt, res.taps)
    ctx = DraftContext(prompt + [12], SamplingParams(temperature=temperature), np.random.default_rng(0), 16,
                       lambda path: allowed)
    tree_ = s.drafter.propose(ctx)
    assert len(tree_) and allowed[tree_.tokens].all()


# -- dynamic trees at a temperature other than 1, with a wrong acceptance rule as the second control ------------

T08 = SamplingParams(temperature=0.8)  # p and the drafter's q both reshaped by the temperature, and unlike each other


def claim_draws_from_q(s, monkeypatch) -> None:
    """WRONG, for a power control only: hand the verifier the dynamic tree's top-k picks as if each had been
    DRAWN from the drafter's q at its parent (accept with min(1, p/q), residual norm(max(0, p - q))) instead
    of as the point masses they are (accept with p(x), residual p without x). The tree and its tokens are the
    real drafter's; only what it claims about them is wrong, as a verifier that trusted q would be."""
    import runtime.drafters.eagle as eagle_module

    rows = {}  # token path from the root -> the drafter's log q after it
    real_tree = eagle_module.dynamic_tree

    def recording_tree(expand, root_scores, tree, max_nodes, stop=None):
        rows[()] = root_scores

        def path(n, tokens, parents):
            out = []
            while n != -1:
                out.append(tokens[n])
                n = parents[n]
            return tuple(out[::-1])

        def expand_and_record(frontier, tokens, parents):
            got = expand(frontier, tokens, parents)
            for n, logq in zip(frontier, got):
                rows[path(n, tokens, parents)] = logq
            return got

        return real_tree(expand_and_record, root_scores, tree, max_nodes, stop)

    monkeypatch.setattr(eagle_module, "dynamic_tree", recording_tree)
    propose = s.drafter.propose

    def wrong(ctx):
        rows.clear()
        tree = propose(ctx)
        if not len(tree):
            return tree
        q = np.stack([np.exp(rows[tuple(tree.tokens[tree.path(i)[:-1]].tolist())]) for i in range(len(tree))])
        return DraftTree(tree.tokens, tree.parents, q=q, deterministic=np.zeros(len(tree), bool))

    monkeypatch.setattr(s.drafter, "propose", wrong)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eagle2_tree", "eagle3_tree"])
def test_dynamic_trees_at_temperature_0_8_keep_the_first_two_tokens_law_and_a_wrong_acceptance_rule_is_rejected(
        model, mode, monkeypatch):
    kind, tree, branching = MODES[mode]
    s = session(model, kind, tree, branching)
    contexts = searched_contexts(s, 1, params=T08)
    for res in certify(s, contexts, T08, draws=DRAWS, alpha=ALPHA, seed=11):
        assert res.passed, res
        assert res.tau > 1.0
    claim_draws_from_q(s, monkeypatch)
    results = certify(s, contexts, T08, draws=DRAWS, alpha=ALPHA, seed=12)
    assert any(not r.passed for r in results), results


def test_cycles_that_draft_nothing_leave_eagle3s_taps_unprojected_until_the_head_next_runs(model):
    """An adaptive shape's plain step must cost the drafter ~nothing: the taps of cycles it did not draft in wait
    raw (the prompt's too) and go through EAGLE-3's fc in ONE product when the head next runs, giving the features row-wise
    projection would (and the same drafts and output: greedy stays plain decoding's)."""
    from runtime.speculation import AdaptivePolicy, CostModel
    s = session(model, "eagle3")
    drafter = s.drafter
    calls = []
    features = drafter._features  # taps -> projected features, at once
    drafter._features = lambda taps: calls.append(len(next(iter(taps.values())))) or features(taps)
    # every verify row costs a full step: the rule drafts nothing but a probe every 5 cycles
    s.engine.policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 2.0))), 3, probe_every=5, prior=0.05)
    prompt = [5, 6, 7, 8, 9]
    out = s.engine.generate(prompt, SamplingParams(), 30)
    assert out.tokens == Engine(s.target, None).generate(prompt, SamplingParams(), 30).tokens
    assert out.stats.skipped_cycles > 10
    assert calls == [], calls  # none at begin nor per cycle: the probes project what waits in one batch
    drafter._features = features
    taps = {t: np.random.default_rng(i).standard_normal((4, model[0].hidden_size)).astype(np.float32)
            for i, t in enumerate(drafter.target_taps)}
    drafter.pending = drafter._features({t: v[:1] for t, v in taps.items()})
    for r in range(1, 4):
        drafter.accept([], [0], {t: v[r:r + 1] for t, v in taps.items()})
    np.testing.assert_allclose(drafter.pending, drafter._features(taps), rtol=1e-5, atol=1e-5)
