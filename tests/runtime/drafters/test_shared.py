"""The drafting pieces every drafter shares (runtime/drafters/shared.py): one pick, one ranking rule, one tree mask,
one loop growing chains split at the root. Their docstrings' worked examples, and the loop against a hand run."""
from types import SimpleNamespace

import numpy as np

from runtime.drafters.shared import grow_chains, pick, ranking_params, tree_mask
from runtime.sampling import SamplingParams
from runtime.tree import DraftTree, path_to


def test_pick_is_the_argmax_when_greedy_and_a_draw_from_q_otherwise():
    q = np.asarray([0.1, 0.7, 0.2])
    assert pick(q, SamplingParams(), np.random.default_rng(0)) == 1
    draws = [pick(q, SamplingParams(temperature=1.0), np.random.default_rng(s)) for s in range(400)]
    assert set(draws) == {0, 1, 2}  # every token q gives mass is drawn


def test_greedy_drafters_rank_at_temperature_one_and_sampled_ones_by_the_request():
    greedy = SamplingParams(top_k=3, repetition_penalty=1.3)
    soft = ranking_params(greedy)
    assert (soft.temperature, soft.top_k, soft.top_p, soft.min_p) == (1.0, 0, 1.0, 0.0)
    assert soft.repetition_penalty == 1.3  # the request's penalty (and mask) still shape the ranking
    sampled = SamplingParams(temperature=0.7, top_p=0.9)
    assert ranking_params(sampled) is sampled


def test_tree_mask_lets_a_row_see_the_committed_rows_its_ancestors_and_itself():
    m = tree_mask(2, [[], [4]], 4)
    assert m.tolist() == [[True, True, False, False, True, False],
                          [True, True, False, False, True, True]]


def test_path_to_is_draft_tree_path_on_a_tree_being_built():
    parents = [-1, -1, 0, 1, 3]
    tree = DraftTree(tokens=np.arange(5, dtype=np.int64), parents=np.asarray(parents, np.int64))
    assert [path_to(parents, i) for i in range(5)] == [tree.path(i) for i in range(5)]
    assert path_to(parents, 4) == [1, 3, 4]


def test_grow_chains_runs_each_level_once_and_extends_every_chain_by_its_argmax():
    # Logits over 6 tokens where the argmax after token t is t + 2: chains 0 -> 2 -> 4 and 1 -> 3 -> 5.
    V = 6
    ctx = SimpleNamespace(params=SamplingParams(), rng=np.random.default_rng(0), mask=lambda path=(): None,
                          stop=None, wants_confidence=False)
    root = np.asarray([3.0, 2.0, 0, 0, 0, 0])
    calls = []

    def run(frontier, tokens, parents, d):
        calls.append((list(frontier), d))
        out = np.zeros((len(frontier), V))
        for j, n in enumerate(frontier):
            out[j, tokens[n] + 2] = 5.0
        return out

    tree = grow_chains(ctx, [9], root, 2, 3, None, run)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, -1, 0, 1, 2, 3]
    assert calls == [([0, 1], 1), ([2, 3], 2)]  # one call per level below the root's children
    assert tree.deterministic.all() and tree.q is None

