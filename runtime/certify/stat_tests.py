"""Goodness-of-fit tests without scipy, for `edgespec certify` on the robot.

chi2_sf is the regularised upper incomplete gamma Q(dof/2, stat/2), computed with the power series for
P (when x < a + 1) or Lentz's continued fraction for Q (otherwise), as in Numerical Recipes ch. 6.2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_EPS = 1e-15
_TINY = 1e-300
_MAX_ITER = 100_000


def _lower_series(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) by its power series; converges fast for x < a + 1."""
    term = 1.0 / a
    total = term
    ap = a
    for _ in range(_MAX_ITER):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_continued_fraction(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) by the modified Lentz continued fraction; for x >= a + 1."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        if abs(d) < _TINY:
            d = _TINY
        c = b + an / c
        if abs(c) < _TINY:
            c = _TINY
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square with dof degrees of freedom. Example: chi2_sf(3.841, 1) ~= 0.05."""
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if math.isnan(stat):
        raise ValueError("chi-square statistic is NaN")
    if stat <= 0.0:
        return 1.0
    if math.isinf(stat):
        return 0.0
    a, x = 0.5 * dof, 0.5 * stat
    if x < a + 1.0:
        return max(0.0, 1.0 - _lower_series(a, x))
    return min(1.0, _upper_continued_fraction(a, x))


@dataclass
class GoodnessOfFit:
    statistic: float  # Pearson chi-square over the pooled bins
    dof: int  # bins - 1
    p_value: float  # chi2_sf(statistic, dof); 0.0 when an impossible outcome was observed
    n: int  # total count
    bins: int  # bins after pooling


def chi_square_gof(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> GoodnessOfFit:
    """Pearson chi-square of observed counts against exact probabilities.

    Bins whose expected count n*p is below min_expected are pooled into one bin; if that pool is still
    below min_expected it is merged with the smallest remaining bin. A count in a zero-probability bin
    means an impossible outcome was produced: p_value 0.0 (statistic inf).

    Example: counts (48, 52) against (0.5, 0.5): statistic 0.16, dof 1, p_value 0.689.
    """
    obs = np.asarray(counts, dtype=np.float64).reshape(-1)
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    if obs.shape != p.shape:
        raise ValueError(f"counts has {obs.shape[0]} bins but probs has {p.shape[0]}")
    if (obs < 0).any() or (p < 0).any() or not np.isfinite(p).all():
        raise ValueError("counts and probs must be non-negative and finite")
    if abs(p.sum() - 1.0) > 1e-6:
        raise ValueError(f"probs sum to {p.sum():.9g}, expected 1")
    n = int(round(obs.sum()))
    if n == 0:
        raise ValueError("no observations")
    impossible = (p == 0) & (obs > 0)
    if impossible.any():
        return GoodnessOfFit(statistic=math.inf, dof=max(int((p > 0).sum()) - 1, 0), p_value=0.0, n=n,
                             bins=int((p > 0).sum()))

    possible = p > 0
    obs, expected = obs[possible], n * p[possible]
    small = expected < min_expected
    big_obs, big_exp = list(obs[~small]), list(expected[~small])
    if small.any():
        pool_obs, pool_exp = float(obs[small].sum()), float(expected[small].sum())
        if pool_exp < min_expected and big_exp:
            j = int(np.argmin(big_exp))
            pool_obs += big_obs.pop(j)
            pool_exp += big_exp.pop(j)
        big_obs.append(pool_obs)
        big_exp.append(pool_exp)
    o, e = np.asarray(big_obs), np.asarray(big_exp)
    bins = int(o.shape[0])
    stat = float(((o - e) ** 2 / e).sum())
    if bins < 2:  # one outcome carries all the mass: nothing to test
        return GoodnessOfFit(statistic=stat, dof=0, p_value=1.0, n=n, bins=bins)
    return GoodnessOfFit(statistic=stat, dof=bins - 1, p_value=chi2_sf(stat, bins - 1), n=n, bins=bins)
