"""Statistical exactness of verify_sampled: speculative cycles must emit tokens distributed exactly as the
(processed) target would sample them, for chains, trees, point masses and processed distributions.

Significance level ALPHA = 0.001 per chi-square test; N_CYCLES = 20 000 independent cycles per configuration;
fixed seeds, so every run draws the same samples. Each configuration is tested twice on the same draws: the
FIRST emitted token (V bins) and the FIRST TWO emitted tokens (V*V bins, pooled where expected < 5).

The synthetic target: V = 10 tokens, p(next | context) depends on the last token through a fixed random
logits table, so the exact distributions come from enumeration:
    first token  ~ P[root]                 pair (a, b) ~ P[root, a] * P[a, b]
Drafters use other tables: GOOD (the target's logits plus small noise) and BAD (unrelated logits). The
same SamplingParams turn both tables into probabilities, as the engine does for p and q.

When a cycle emits only one token, the second token is sampled from the exact target after it (a plain
decoding step). That is what the next cycle would produce if verification is exact, and it keeps the
pair test about the cycle under test rather than a second speculative cycle; a wrong rule that only
distorts tokens after the first still shows up through cycles that emit two or more tokens.

Control tests run deliberately wrong rules through the same harness and assert p_value < ALPHA, so a pass
above means the harness could have failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import pytest

from runtime.certify.run import forget_residual
from runtime.sampling import SamplingParams, process_logits_batch, sample
from runtime.certify.stat_tests import chi2_sf, chi_square_gof
from runtime.tree import DraftTree, from_choices
from runtime.verify import VerifyResult, verify_sampled

ALPHA = 0.001
N_CYCLES = 20_000
V = 10
ROOT = 3  # the pending token every cycle starts from

_TABLE_RNG = np.random.default_rng(20240611)
TARGET_LOGITS = _TABLE_RNG.normal(0.0, 1.5, size=(V, V))  # row = last token
GOOD_LOGITS = TARGET_LOGITS + _TABLE_RNG.normal(0.0, 0.4, size=(V, V))
BAD_LOGITS = _TABLE_RNG.normal(0.0, 1.5, size=(V, V))

PLAIN = SamplingParams(temperature=1.0)
PROCESSED = SamplingParams(temperature=0.7, top_p=0.8)

Verifier = Callable[[DraftTree, np.ndarray, np.random.Generator], VerifyResult]


@dataclass(frozen=True)
class Shape:
    """A draft tree shape: parents, and which nodes are point masses (argmax of q) rather than draws from q."""

    parents: Tuple[int, ...]
    deterministic: Optional[Tuple[bool, ...]] = None  # None = all sampled
    distinct_siblings: bool = False  # siblings drawn without replacement (runtime/siblings.py)
    stale_q: bool = False  # WRONG (controls only): distinct siblings verified against the plain q, not their own


CHAIN_4 = Shape(parents=(-1, 0, 1, 2))
# root ── 0 ── 3 ; root ── 1 ── 4 ; root ── 2 ── 5   (three i.i.d. siblings, each with one child)
THREE_BRANCH = Shape(parents=(-1, -1, -1, 0, 1, 2))
# two children at depth 1, two or one at depth 2, one or two at depth 3
DEPTH_3 = Shape(parents=(-1, -1, 0, 0, 1, 2, 3, 4, 4))
POINT_MASS_CHAIN_3 = Shape(parents=(-1, 0, 1), deterministic=(True, True, True))
# an argmax child followed by two sampled siblings (EAGLE-style mix), one child under each
MIXED_SIBLINGS = Shape(parents=(-1, -1, -1, 0, 1), deterministic=(True, False, False, False, True))


def _tables(params: SamplingParams, draft_logits: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    return process_logits_batch(TARGET_LOGITS, params), process_logits_batch(draft_logits, params)


def _draw_rows(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Vectorised inverse-CDF: one token per row of cdf (N, V) for uniforms u (N,)."""
    return (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)


def draft_tokens(shape: Shape, Q: np.ndarray, n: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """(n, nodes) draft tokens for n cycles and (n, nodes, V) the proposal each was drawn from: sampled
    nodes draw independently from Q[parent token], or, with distinct_siblings, from Q[parent token]
    without the earlier sampled siblings, renormalised (stale_q then records the plain row instead)."""
    det = shape.deterministic or (False,) * len(shape.parents)
    toks = np.zeros((n, len(shape.parents)), dtype=np.int64)
    props = np.zeros((n, len(shape.parents), V))
    for i, par in enumerate(shape.parents):
        ctx = np.full(n, ROOT) if par < 0 else toks[:, par]
        props[:, i] = Q[ctx]
        if det[i]:
            toks[:, i] = np.argmax(Q[ctx], axis=1)
            continue
        q = Q[ctx].copy()  # (n, V)
        if shape.distinct_siblings:
            for j in range(i):
                if shape.parents[j] == par and not det[j]:
                    q[np.arange(n), toks[:, j]] = 0.0
            q /= q.sum(axis=1, keepdims=True)
            if not shape.stale_q:
                props[:, i] = q
        toks[:, i] = _draw_rows(np.cumsum(q, axis=1), rng.random(n))
    return toks, props


def run_cycles(
    shape: Shape, P: np.ndarray, Q: np.ndarray, seed: int, verify: Verifier = verify_sampled,
    fixed_tree: Optional[DraftTree] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Counts of the first emitted token (V,) and of the first two (V*V,) over N_CYCLES cycles."""
    rng = np.random.default_rng(seed)
    p_cdf = np.cumsum(P, axis=1)
    if fixed_tree is None:
        toks, props = draft_tokens(shape, Q, N_CYCLES, rng)
        parents = np.asarray(shape.parents, dtype=np.int64)
        det = np.asarray(shape.deterministic or (False,) * len(parents))
    first = np.zeros(V, dtype=np.int64)
    pairs = np.zeros(V * V, dtype=np.int64)
    second_u = rng.random(N_CYCLES)
    for k in range(N_CYCLES):
        if fixed_tree is None:
            tree = DraftTree(tokens=toks[k], parents=parents, q=props[k], deterministic=det)
        else:
            tree = fixed_tree
        res = verify(tree, P[np.concatenate(([ROOT], tree.tokens))], rng)
        emitted = tree.tokens[res.accepted].tolist() + [res.next_token]
        a = emitted[0]
        b = emitted[1] if len(emitted) > 1 else int(np.searchsorted(p_cdf[a], second_u[k] * p_cdf[a, -1], "right"))
        first[a] += 1
        pairs[a * V + b] += 1
    return first, pairs


def p_values(P: np.ndarray, first: np.ndarray, pairs: np.ndarray) -> Tuple[float, float]:
    exact_first = P[ROOT]
    exact_pairs = (exact_first[:, None] * P).ravel()
    return chi_square_gof(first, exact_first).p_value, chi_square_gof(pairs, exact_pairs).p_value


def assert_exact(shape: Shape, params: SamplingParams, draft_logits: np.ndarray, seed: int, **kw) -> None:
    P, Q = _tables(params, draft_logits)
    first, pairs = run_cycles(shape, P, Q, seed, **kw)
    p_first, p_pairs = p_values(P, first, pairs)
    assert p_first > ALPHA, f"first-token distribution differs from the target (p = {p_first:.2e})"
    assert p_pairs > ALPHA, f"first-two-token distribution differs from the target (p = {p_pairs:.2e})"


# --- exactness ------------------------------------------------------------------------------------------

def test_sampled_chain_with_good_draft_matches_target_distribution():
    assert_exact(CHAIN_4, PLAIN, GOOD_LOGITS, seed=1)


def test_sampled_chain_with_bad_draft_matches_target_distribution():
    assert_exact(CHAIN_4, PLAIN, BAD_LOGITS, seed=2)


def test_point_mass_chain_matches_target_distribution():
    assert_exact(POINT_MASS_CHAIN_3, PLAIN, BAD_LOGITS, seed=3)


def test_sampled_three_branch_tree_with_iid_siblings_matches_target_distribution():
    assert_exact(THREE_BRANCH, PLAIN, BAD_LOGITS, seed=4)


def test_siblings_without_replacement_with_their_own_proposals_match_target_distribution():
    # Recursive rejection sampling: child i's q is the parent's q without the earlier siblings.
    assert_exact(Shape(parents=(-1, -1, -1, 0, 1, 2), distinct_siblings=True), PLAIN, BAD_LOGITS, seed=10)


def test_distinct_siblings_after_a_point_mass_match_target_distribution():
    shape = Shape(parents=(-1, -1, -1, 0, 1), deterministic=(True, False, False, False, True), distinct_siblings=True)
    assert_exact(shape, PLAIN, GOOD_LOGITS, seed=11)


def test_sampled_depth_three_tree_matches_target_distribution():
    assert_exact(DEPTH_3, PLAIN, GOOD_LOGITS, seed=5)


def test_tree_mixing_point_mass_and_sampled_siblings_matches_target_distribution():
    assert_exact(MIXED_SIBLINGS, PLAIN, BAD_LOGITS, seed=6)


def test_static_top_k_tree_from_choices_matches_target_distribution():
    _, Q = _tables(PLAIN, GOOD_LOGITS)
    top = np.argsort(-Q, axis=1, kind="stable")
    candidates = [top[ROOT, :3], top[top[ROOT, 0], :2]]  # Medusa: one candidate list per depth
    tree = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]], candidates)
    assert_exact(Shape(parents=()), PLAIN, GOOD_LOGITS, seed=7, fixed_tree=tree)


def test_sampled_chain_with_temperature_and_top_p_matches_processed_target_distribution():
    assert_exact(CHAIN_4, PROCESSED, GOOD_LOGITS, seed=8)


def test_sampled_tree_with_temperature_and_top_p_matches_processed_target_distribution():
    assert_exact(THREE_BRANCH, PROCESSED, BAD_LOGITS, seed=9)


# --- controls: wrong rules must fail the same harness ---------------------------------------------------

def _accept_everything(tree: DraftTree, probs: np.ndarray, rng: np.random.Generator) -> VerifyResult:
    """WRONG: trusts the drafter; emits the whole first branch and a bonus token."""
    path: List[int] = []
    node = -1
    while kids := tree.children(node):
        node = kids[0]
        path.append(node)
    return VerifyResult(accepted=path, next_token=sample(probs[node + 1], rng))


def _control_p_values(verify: Verifier, shape: Shape, seed: int) -> Tuple[float, float]:
    P, Q = _tables(PLAIN, BAD_LOGITS)
    first, pairs = run_cycles(shape, P, Q, seed, verify=verify)
    return p_values(P, first, pairs)


def test_control_accepting_every_draft_token_is_detected():
    p_first, p_pairs = _control_p_values(_accept_everything, CHAIN_4, seed=101)
    assert p_first < ALPHA and p_pairs < ALPHA


def test_control_sampling_p_instead_of_the_residual_is_detected():
    p_first, p_pairs = _control_p_values(forget_residual, CHAIN_4, seed=102)
    assert p_first < ALPHA and p_pairs < ALPHA



def test_control_siblings_without_replacement_verified_against_the_plain_q_are_detected():
    # The right rule fed the wrong proposals: distinct siblings verified as if they were i.i.d. draws from
    # q. This is why each node carries its own proposal (runtime/siblings.py).
    shape = Shape(parents=(-1, -1, -1), distinct_siblings=True, stale_q=True)
    p_first, _ = _control_p_values(verify_sampled, shape, seed=103)
    assert p_first < ALPHA


# --- the chi-square machinery itself (what `edgespec certify` runs without scipy) -----------------------

def test_chi2_sf_matches_scipy_over_a_grid():
    from scipy.stats import chi2

    for dof in (1, 2, 3, 4, 7, 10, 30, 99, 500):
        for stat in np.concatenate([[1e-6, 0.01, 0.5, dof, dof + 2.0], np.linspace(0.1, 4 * dof + 60, 40)]):
            want = chi2.sf(stat, dof)
            assert chi2_sf(float(stat), dof) == pytest.approx(want, rel=1e-9, abs=1e-300), (stat, dof)


def test_chi2_sf_edge_values():
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(float("inf"), 3) == 0.0
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    with pytest.raises(ValueError):
        chi2_sf(1.0, 0)


def test_chi_square_gof_hand_example():
    fit = chi_square_gof(np.array([48, 52]), np.array([0.5, 0.5]))
    assert (fit.statistic, fit.dof, fit.n, fit.bins) == (pytest.approx(0.16), 1, 100, 2)
    assert fit.p_value == pytest.approx(0.6891565, rel=1e-6)


def test_chi_square_gof_pools_bins_with_small_expected_counts():
    # n = 100: expected (60, 30, 4, 3, 3) -> the last three pool into one bin of 10.
    fit = chi_square_gof(np.array([60, 30, 5, 3, 2]), np.array([0.6, 0.3, 0.04, 0.03, 0.03]))
    assert fit.bins == 3 and fit.dof == 2 and fit.statistic == pytest.approx(0.0)


def test_chi_square_gof_merges_a_still_small_pool_with_the_smallest_bin():
    # n = 100: expected (80, 16, 2, 2): pool of 4 < 5 merges with the 16 -> bins (80, 20).
    fit = chi_square_gof(np.array([70, 20, 5, 5]), np.array([0.8, 0.16, 0.02, 0.02]))
    assert fit.bins == 2 and fit.dof == 1
    assert fit.statistic == pytest.approx(10**2 / 80 + 10**2 / 20)


def test_chi_square_gof_impossible_outcome_has_p_value_zero():
    fit = chi_square_gof(np.array([50, 49, 1]), np.array([0.5, 0.5, 0.0]))
    assert fit.p_value == 0.0 and fit.statistic == float("inf")


def test_chi_square_gof_ignores_zero_probability_bins_with_no_counts():
    fit = chi_square_gof(np.array([48, 52, 0]), np.array([0.5, 0.5, 0.0]))
    assert fit.bins == 2 and fit.p_value == pytest.approx(0.6891565, rel=1e-6)


def test_chi_square_gof_rejects_probabilities_not_summing_to_one():
    with pytest.raises(ValueError, match="sum"):
        chi_square_gof(np.array([1, 1]), np.array([0.5, 0.6]))
