"""Verification rules on hand examples: greedy paths, acceptance/residual maths, and sampled-rule mechanics
with a scripted RNG (the statistical exactness suite is tests/runtime/test_verify_exactness.py)."""

import numpy as np
import pytest

from runtime.tree import DraftTree, chain, empty_tree
from runtime.verify import acceptance_probability, residual, verify_greedy, verify_greedy_choices, verify_sampled

V = 6


def one_hot_rows(argmaxes, vocab=V):
    rows = np.zeros((len(argmaxes), vocab))
    rows[np.arange(len(argmaxes)), argmaxes] = 1.0
    return rows


class ScriptedRng:
    """Returns the given uniforms in order for random(); fails loudly if the rule draws more than scripted."""

    def __init__(self, *uniforms):
        self.uniforms = list(uniforms)

    def random(self):
        return self.uniforms.pop(0)


# --- the worked self-check -------------------------------------------------------------------------------

P_CHECK = np.array([0.6, 0.3, 0.1])
Q_CHECK = np.array([0.3, 0.3, 0.4])


def test_self_check_acceptance_probability_is_sum_of_minimum():
    assert acceptance_probability(P_CHECK, Q_CHECK) == pytest.approx(0.7)


def test_self_check_residual_is_normalised_positive_part():
    np.testing.assert_allclose(residual(P_CHECK, Q_CHECK), [1.0, 0.0, 0.0])


def test_residual_of_identical_distributions_falls_back_to_p():
    np.testing.assert_allclose(residual(P_CHECK, P_CHECK), P_CHECK)


def test_acceptance_probability_is_one_for_identical_and_zero_for_disjoint():
    assert acceptance_probability(P_CHECK, P_CHECK) == pytest.approx(1.0)
    assert acceptance_probability([1, 0], [0, 1]) == 0.0


# --- greedy ----------------------------------------------------------------------------------------------

def test_greedy_full_accept_emits_the_bonus_token():
    tree = chain([2, 3, 4])
    res = verify_greedy(tree, one_hot_rows([2, 3, 4, 5]))
    assert res.accepted == [0, 1, 2] and res.next_token == 5


def test_greedy_stops_at_the_first_mismatch_and_emits_the_targets_token():
    res = verify_greedy(chain([2, 3, 4]), one_hot_rows([2, 1, 4, 5]))
    assert res.accepted == [0] and res.next_token == 1


def test_greedy_mismatch_at_the_first_token_accepts_nothing():
    res = verify_greedy(chain([2, 3]), one_hot_rows([0, 3, 4]))
    assert res.accepted == [] and res.next_token == 0


def test_greedy_tree_follows_the_branch_matching_the_target():
    # root ── 0:(1) ── 3:(2)
    #      ├─ 1:(4) ── 4:(5) ── 5:(0)
    #      └─ 2:(3)
    tree = DraftTree(tokens=np.array([1, 4, 3, 2, 5, 0]), parents=np.array([-1, -1, -1, 0, 1, 4]))
    rows = one_hot_rows([4, 2, 5, 1, 0, 0, 3])  # row 0: root, row i+1: node i
    res = verify_greedy(tree, rows)
    assert res.accepted == [1, 4, 5] and res.next_token == 3


def test_greedy_takes_the_first_matching_sibling_in_index_order():
    tree = DraftTree(tokens=np.array([3, 3]), parents=np.array([-1, -1]))
    res = verify_greedy(tree, one_hot_rows([3, 1, 2]))
    assert res.accepted == [0] and res.next_token == 1


def test_greedy_accepts_full_distributions_by_argmax():
    rows = np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])
    res = verify_greedy(chain([1, 0]), rows)
    assert res.accepted == [0, 1] and res.next_token == 2


def test_greedy_on_the_empty_tree_is_plain_argmax_decoding():
    res = verify_greedy(empty_tree(), one_hot_rows([4]))
    assert res.accepted == [] and res.next_token == 4


def test_verify_rejects_target_rows_of_the_wrong_count():
    with pytest.raises(ValueError, match="expected \\(3, V\\)"):
        verify_greedy(chain([1, 2]), one_hot_rows([1, 2]))
    with pytest.raises(ValueError, match="expected \\(3, V\\)"):
        verify_sampled(chain([1, 2]), one_hot_rows([1, 2]), np.random.default_rng(0))


# --- sampled rule mechanics with scripted uniforms --------------------------------------------------------

def test_sampled_chain_accepts_when_u_is_below_p_over_q():
    # x = 2 drawn from q = Q_CHECK: ratio 0.1 / 0.4 = 0.25.
    tree = chain([2], q=Q_CHECK[None, :])
    rows = np.stack([P_CHECK, [0.0, 1.0, 0.0]])
    res = verify_sampled(tree, rows, ScriptedRng(0.24, 0.5))
    assert res.accepted == [0] and res.next_token == 1  # bonus from row 1


def test_sampled_chain_rejection_samples_the_residual():
    tree = chain([2], q=Q_CHECK[None, :])
    rows = np.stack([P_CHECK, [0.0, 1.0, 0.0]])
    res = verify_sampled(tree, rows, ScriptedRng(0.26, 0.99))
    assert res.accepted == [] and res.next_token == 0  # residual (1, 0, 0), whatever the second draw


def test_sampled_token_with_p_above_q_is_always_accepted():
    tree = chain([0], q=Q_CHECK[None, :])  # ratio 2
    rows = np.stack([P_CHECK, [0.0, 0.0, 1.0]])
    res = verify_sampled(tree, rows, ScriptedRng(0.999999, 0.0))
    assert res.accepted == [0] and res.next_token == 2


def test_point_mass_draft_is_accepted_with_probability_p_of_its_token():
    tree = chain([1])  # deterministic: q = one-hot(1), p(1) = 0.3
    rows = np.stack([P_CHECK, [1.0, 0.0, 0.0]])
    assert verify_sampled(tree, rows, ScriptedRng(0.29, 0.0)).accepted == [0]
    res = verify_sampled(tree, rows, ScriptedRng(0.31, 0.0))
    assert res.accepted == []


def test_point_mass_rejection_samples_p_with_the_draft_token_zeroed():
    tree = chain([0])  # p(0) = 0.6 -> residual (0, 0.75, 0.25)
    rows = np.stack([P_CHECK, [1.0, 0.0, 0.0]])
    assert verify_sampled(tree, rows, ScriptedRng(0.7, 0.74)).next_token == 1
    assert verify_sampled(tree, rows, ScriptedRng(0.7, 0.76)).next_token == 2
    # and it equals the general rule with q one-hot:
    np.testing.assert_allclose(residual(P_CHECK, [1.0, 0.0, 0.0]), [0.0, 0.75, 0.25])


def test_rejected_sibling_updates_p_before_the_next_sibling_is_tried():
    # Two sampled siblings x = 2 and x = 1, both from q = Q_CHECK. After rejecting x = 2 p becomes
    # (1, 0, 0), so x = 1 has ratio 0 and must be rejected whatever u is; then token 0 is emitted.
    q = np.stack([Q_CHECK, Q_CHECK])
    tree = DraftTree(tokens=np.array([2, 1]), parents=np.array([-1, -1]), q=q)
    rows = np.stack([P_CHECK, [1.0, 0, 0], [1.0, 0, 0]])
    res = verify_sampled(tree, rows, ScriptedRng(0.9, 0.0, 0.5))
    assert res.accepted == [] and res.next_token == 0


def test_second_sibling_is_accepted_and_its_subtree_entered():
    # root ── 0:(2) ; root ── 1:(0) ── 2:(1). Reject node 0, accept node 1 (ratio 1/0.3 after residual), then node 2.
    q = np.stack([Q_CHECK, Q_CHECK, [0.0, 1.0, 0.0]])
    tree = DraftTree(tokens=np.array([2, 0, 1]), parents=np.array([-1, -1, 1]), q=q)
    rows = np.stack([P_CHECK, [1.0, 0, 0], [0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    res = verify_sampled(tree, rows, ScriptedRng(0.9, 0.999, 0.49, 0.3))
    assert res.accepted == [1, 2] and res.next_token == 2


def test_sampled_node_whose_token_q_gives_zero_is_a_drafter_bug():
    tree = chain([2], q=np.array([[0.5, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="drafter bug"):
        verify_sampled(tree, np.stack([P_CHECK, P_CHECK]), ScriptedRng(0.5, 0.5))


def test_sampled_verification_with_greedy_rows_reproduces_greedy():
    rng = np.random.default_rng(1)
    tree = chain([2, 3, 4])
    for rows in (one_hot_rows([2, 3, 4, 5]), one_hot_rows([2, 1, 4, 5])):
        want = verify_greedy(tree, rows)
        got = verify_sampled(tree, rows, rng)
        assert (got.accepted, got.next_token) == (want.accepted, want.next_token)


def test_sampled_empty_tree_samples_the_root_row():
    res = verify_sampled(empty_tree(), np.array([[0.0, 0.0, 1.0]]), np.random.default_rng(0))
    assert res.accepted == [] and res.next_token == 2


def test_greedy_verification_from_the_argmax_per_row_is_verify_greedy_on_the_distributions():
    """The engine's plain-greedy path hands verification the (n+1,) argmaxes instead of (n+1, V) rows."""
    rng = np.random.default_rng(4)
    for n in (0, 1, 3, 6):
        for _ in range(40):
            parents = np.array([rng.integers(-1, i) for i in range(n)], np.int64)
            tree = DraftTree(tokens=rng.integers(0, 3, n), parents=parents)
            choices = rng.integers(0, 3, n + 1)
            want = verify_greedy(tree, one_hot_rows(choices))
            got = verify_greedy_choices(tree, choices)
            assert (got.accepted, got.next_token) == (want.accepted, want.next_token)
    with pytest.raises(ValueError, match="2 target choices, expected 3"):
        verify_greedy_choices(chain([1, 2]), np.array([1, 2]))
