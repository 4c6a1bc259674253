"""The sibling rule: how a drafter picks several children of one tree node, and the proposal distribution
each child is verified against. Every drafter that builds trees takes its siblings from here, so that what
the drafter did and what the verifier assumes cannot drift apart.

Sampled siblings are drawn WITHOUT replacement (recursive rejection sampling, Jeon et al. 2024): child i
is drawn from q with the earlier siblings removed and renormalised, and that renormalised row is what the
tree records as child i's proposal. `verify_sampled` then runs the plain recursive rule over the children
in order (accept x_i with min(1, p_i(x_i) / q_i(x_i)), else p_{i+1} = norm(max(0, p_i - q_i))), which is
exact whenever each x_i is drawn from the q_i recorded for it, whatever q_i depends on. Unlike i.i.d.
siblings it never spends a verify row on a duplicate.

Why the obvious shortcut is wrong: drawing i.i.d. from q and dropping duplicates skips the rejection step
the duplicate would have made, and that step also moves the residual (p'' = norm(max(0, p' - q))), so the
final correction is drawn from the wrong law. The bias is largest where q is peaked, i.e. where duplicates
are common (issue 10; `runtime.certify.run.dedup_siblings` keeps that rule as a power control).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from runtime.sampling import sample


@dataclass
class Siblings:
    tokens: np.ndarray  # (m,) int64 children, in the order the verifier tries them
    proposals: Optional[np.ndarray]  # (m, V) float64: the distribution child i was drawn from; None = point masses

    @property
    def deterministic(self) -> bool:
        return self.proposals is None


def without_replacement(q: np.ndarray, width: int, rng: np.random.Generator,
                        exclude: Sequence[int] = ()) -> Siblings:
    """Up to `width` distinct draws from q; child i's proposal is q without the earlier children (and
    without `exclude`, e.g. point-mass siblings placed before them), renormalised. Stops early when q has
    no mass left, so a peaked q gives fewer children rather than wasted rows.

    Example: q = (0.5, 0.3, 0.2), width 2. If the first draw is 0 its proposal is (0.5, 0.3, 0.2); the
    second is drawn from (0, 0.6, 0.4), which is its proposal. q = (1, 0, 0), width 3 -> one child, token 0.
    """
    rest = np.array(q, dtype=np.float64)  # (V,) private: drawn tokens are zeroed in it
    rest[np.asarray(exclude, dtype=np.int64)] = 0.0
    tokens, rows = [], []
    for _ in range(width):
        total = rest.sum()
        if not total > 0.0:
            break
        row = rest / total
        t = sample(row, rng)
        tokens.append(t)
        rows.append(row)
        rest[t] = 0.0
    if not tokens:
        return Siblings(np.zeros(0, np.int64), np.zeros((0, rest.shape[0])))
    return Siblings(np.asarray(tokens, np.int64), np.stack(rows))


def iid_with_replacement(q: np.ndarray, width: int, rng: np.random.Generator,
                         exclude: Sequence[int] = ()) -> Siblings:
    """`width` i.i.d. draws from q, duplicates KEPT as separate children (SpecInfer multi-step sampling).
    Exact too, but a duplicate of a rejected token costs a verify row and is always rejected; kept to
    measure against `without_replacement` (`exclude` is accepted for the same signature and must be empty).

    Example: q = (1, 0, 0), width 2 -> children (0, 0), both with proposal q.
    """
    if len(exclude):
        raise ValueError("i.i.d. siblings cannot exclude tokens: that would change their proposal")
    row = np.asarray(q, dtype=np.float64)
    tokens = [sample(row, rng) for _ in range(width)]
    return Siblings(np.asarray(tokens, np.int64), np.repeat(row[None, :], width, axis=0))


def top_k(scores: np.ndarray, width: int) -> Siblings:
    """The `width` highest-scoring tokens with positive score (ties -> lowest id), as point masses: a
    deterministic choice, verified by the point-mass rule (accept x with p(x), else zero it in p).

    Example: scores (0.1, 0.6, 0, 0.3), width 3 -> tokens (1, 3, 0).
    """
    s = np.asarray(scores)
    n = s.shape[0]
    if 0 < width < n:
        # The same tokens as a full stable sort, in O(V): only those scoring at least the width-th best (ties
        # included, in id order) are sorted. (Fewer than `width` of them: NaN scores, which the partition counts
        # as the largest and the full sort places last; then the full sort.)
        kth = np.partition(s, n - width)[n - width]
        cand = np.flatnonzero(s >= kth)
        if len(cand) >= width:
            order = cand[np.argsort(-s[cand], kind="stable")][:width]
            return Siblings(order[s[order] > 0].astype(np.int64), None)
    order = np.argsort(-s, kind="stable")[:max(width, 0)]
    return Siblings(np.asarray([t for t in order if s[t] > 0], np.int64), None)


# What drafters use. Replaceable per drafter instance only so that `certify` can show it detects a wrong rule.
draw_siblings = without_replacement
