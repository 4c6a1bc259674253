"""The sibling rule (runtime/siblings.py) through the real drafter code path (`pick_children`) and the real
verifier (`verify_sampled`), on a 3-token toy where the exact law of the first emitted token is p itself.

alpha = 0.001; N_DRAWS = 200 000 draws for the width-2 rule and its control, N_QUICK = 50 000 for the other
exact rules (they only have to pass); fixed seeds. The toy puts a peaked drafter q on a
token the target does not favour, which is where a wrong sibling rule shows: with q = (0.8, 0.1, 0.1)
two i.i.d. draws coincide two times in three. The power control runs the duplicate-dropping rule of
issue 10 (its exact law, enumerated below, is (0.2, 0.48, 0.32) instead of (0.2, 0.5, 0.3)) through the
same harness and must be rejected.
"""
from __future__ import annotations

import numpy as np
import pytest

from runtime.certify.run import dedup_siblings
from runtime.drafters.shared import pick_children
from runtime.sampling import SamplingParams
from runtime.siblings import iid_with_replacement, top_k, without_replacement
from runtime.certify.stat_tests import chi_square_gof
from runtime.tree import DraftTree
from runtime.verify import verify_sampled

ALPHA = 1e-3
N_DRAWS = 200_000
N_QUICK = 50_000
P = np.array([0.2, 0.5, 0.3])  # the target's distribution at the node
Q = np.array([0.8, 0.1, 0.1])  # the drafter's: peaked, on the token the target likes least
SAMPLED = SamplingParams(temperature=1.0)


def first_token_counts(rule, width: int, seed: int, draws: int = N_DRAWS) -> np.ndarray:
    """Draw siblings with the real drafter path, verify them with the real verifier, count what is emitted."""
    draft_rng, verify_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 0])
    counts = np.zeros(P.shape[0])
    rows = np.repeat(P[None, :], width + 1, axis=0)  # children are leaves; their rows are never used here
    for _ in range(draws):
        kids = pick_children(np.log(Q), Q, SAMPLED, [], width, draft_rng, rule)
        m = kids.tokens.shape[0]
        tree = DraftTree(tokens=kids.tokens, parents=np.full(m, -1), q=kids.proposals)
        res = verify_sampled(tree, rows[:m + 1], verify_rng)
        counts[int(tree.tokens[res.accepted[0]]) if res.accepted else res.next_token] += 1
    return counts


@pytest.mark.parametrize("width,draws", [(2, N_DRAWS), (3, N_QUICK)])
def test_siblings_drawn_without_replacement_leave_the_target_distribution_unchanged(width, draws):
    fit = chi_square_gof(first_token_counts(without_replacement, width, seed=10 + width, draws=draws), P)
    assert fit.p_value > ALPHA, fit


def test_iid_siblings_with_duplicates_kept_leave_the_target_distribution_unchanged():
    fit = chi_square_gof(first_token_counts(iid_with_replacement, 2, seed=20, draws=N_QUICK), P)
    assert fit.p_value > ALPHA, fit


def test_control_dropping_duplicate_siblings_is_detected():
    fit = chi_square_gof(first_token_counts(dedup_siblings, 2, seed=30), P)
    assert fit.p_value < ALPHA, fit


def test_the_duplicate_dropping_rule_is_biased_by_enumeration():
    # Draws (0,0) p=.64 -> one child 0; (0,x)/(x,0) -> [0,x]/[x,0]; (x,x) -> [x]. Exact law by hand-rolled
    # enumeration of the verifier's branches: the bias the control above detects is real, not noise.
    law = np.zeros(3)
    for a in range(3):
        for b in range(3):
            kids = [a] if a == b else [a, b]
            _enumerate_verify(P.copy(), kids, Q[a] * Q[b], law)
    assert law == pytest.approx([0.2, 0.48, 0.32])


def _enumerate_verify(p, kids, prob, law):
    if not kids:
        law += prob * p
        return
    x = kids[0]
    a = min(1.0, p[x] / Q[x])
    law[x] += prob * a
    if a < 1.0:
        r = np.maximum(p - Q, 0.0)
        _enumerate_verify(r / r.sum(), kids[1:], prob * (1 - a), law)


def test_without_replacement_records_the_renormalised_proposal_of_each_child():
    kids = without_replacement(np.array([0.5, 0.3, 0.2]), 3, np.random.default_rng(0))
    assert sorted(kids.tokens.tolist()) == [0, 1, 2]
    first = kids.tokens[0]
    assert kids.proposals[0] == pytest.approx([0.5, 0.3, 0.2])
    assert kids.proposals[1][first] == 0.0 and kids.proposals[1].sum() == pytest.approx(1.0)
    assert kids.proposals[1][kids.tokens[1]] > 0
    assert kids.proposals[2] == pytest.approx(np.eye(3)[kids.tokens[2]])


def test_without_replacement_stops_when_q_runs_out_of_mass():
    kids = without_replacement(np.array([1.0, 0.0, 0.0]), 3, np.random.default_rng(0))
    assert kids.tokens.tolist() == [0]


def test_without_replacement_excludes_point_mass_siblings_placed_before():
    kids = without_replacement(np.array([0.6, 0.3, 0.1]), 2, np.random.default_rng(0), exclude=[0])
    assert 0 not in kids.tokens.tolist()
    assert kids.proposals[0] == pytest.approx([0.0, 0.75, 0.25])


def test_top_k_siblings_are_point_masses_in_score_order():
    kids = top_k(np.array([0.1, 0.6, 0.0, 0.3]), 3)
    assert kids.tokens.tolist() == [1, 3, 0] and kids.deterministic
