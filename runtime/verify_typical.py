"""Medusa's typical acceptance: a LOSSY verification rule, used only when the config asks for it by name
(`decoding.lossy_typical_acceptance`, flag --lossy-typical-acceptance). Never the default, never certified.

A drafted token x is accepted where the target's row p says it is "typical enough":

    p(x) > min(epsilon, delta * exp(-H(p)))          H(p) = -sum p log p  (nats)

(Medusa, Cai et al. 2024, section 2.3.1; FasterDecoding/Medusa `evaluate_posterior`, defaults
posterior_threshold = epsilon = 0.09, posterior_alpha = delta = 0.3; its code takes log(p + 1e-5) in H, here H
is exact, over the target's processed row: temperature, top-k/p, masks applied). In a tree the longest path whose
nodes all pass is kept (ties: the larger sum of log p(x)), then the next token is drawn from the target's row
after that path. No coin is tossed against a proposal and no residual is taken, so the emitted law is NOT the target's:
a plausible drafted token is always kept, and after a rejection p is sampled whole (it may draw the very token
just rejected). It buys acceptance at high temperature at the price of exactness; `edgespec certify` refuses it.
Greedy requests (temperature 0) never use it: they keep `verify_greedy`, exact.
"""
from __future__ import annotations

import functools
from typing import Callable, List

import numpy as np

from runtime.sampling import sample
from runtime.tree import DraftTree
from runtime.verify import VerifyResult, _check_shapes

EPSILON = 0.09  # Medusa's posterior_threshold: a hard floor that always suffices
DELTA = 0.3  # Medusa's posterior_alpha: the entropy-scaled part


def typical_threshold(p: np.ndarray, epsilon: float = EPSILON, delta: float = DELTA) -> float:
    """min(epsilon, delta * exp(-H(p))): the probability a drafted token must exceed under typical acceptance.

    Example: p = (0.5, 0.5): H = ln 2, delta * exp(-H) = 0.3 * 0.5 = 0.15 -> threshold min(0.09, 0.15) = 0.09.
    p = (0.25,) * 4: H = ln 4 -> 0.3 / 4 = 0.075 < 0.09 -> threshold 0.075 (a flat row asks for less)."""
    p = np.asarray(p, dtype=np.float64)
    nz = p[p > 0.0]
    entropy = float(-(nz * np.log(nz)).sum())
    return min(float(epsilon), float(delta) * float(np.exp(-entropy)))


def typical_accepts(p: np.ndarray, token: int, epsilon: float = EPSILON, delta: float = DELTA) -> bool:
    """Whether typical acceptance keeps `token` against the target row `p` (strictly above the threshold).

    Example: p = (0.5, 0.42, 0.08): H = 0.91, threshold min(0.09, 0.3 * 0.40) = 0.09 -> token 1 kept (0.42),
    token 2 not (0.08)."""
    return float(np.asarray(p)[token]) > typical_threshold(p, epsilon, delta)


def verify_typical_lossy(tree: DraftTree, target_probs: np.ndarray, rng: np.random.Generator,
                         epsilon: float = EPSILON, delta: float = DELTA) -> VerifyResult:
    """LOSSY. Keep the deepest node reachable from the root through nodes that all pass `typical_accepts`
    (ties: larger sum of log p(x) along the path, then the lower node index); next_token ~ the target's row
    after it. Same contract as `verify_sampled` (same arguments, same result), different law.

    Example: tree tokens (3, 5, 7), parents (-1, -1, 0), rows: root p = (.., p3 = 0.4, p5 = 0.5, ..), after
    node 0 p7 = 0.6: nodes 0 and 1 pass at depth 1, node 2 passes at depth 2 -> accepted [0, 2] (the longest),
    next_token ~ row 3 (after node 2). Had node 2 failed, [1] (depth 1, log 0.5 > log 0.4)."""
    probs = _check_shapes(tree, target_probs)
    kids = tree.children_lists()
    tokens = tree.tokens.tolist()
    thresholds = [typical_threshold(row, epsilon, delta) for row in probs]  # row r: after root / node r-1
    best = (0, 0.0, 0)  # (depth, log-likelihood, -node) of the best node so far; node -1 = the root
    best_node = -1
    stack = [(-1, 0, 0.0)]  # (node, depth, sum log p(x) on its path)
    while stack:
        node, depth, loglik = stack.pop()
        for c in kids[node + 1]:
            px = float(probs[node + 1][tokens[c]])
            if px > thresholds[node + 1]:
                key = (depth + 1, loglik + np.log(px), -c)
                if key > best:
                    best, best_node = key, c
                stack.append((c, depth + 1, loglik + float(np.log(px))))
    accepted: List[int] = tree.path(best_node) if best_node >= 0 else []
    return VerifyResult(accepted=accepted, next_token=sample(np.asarray(probs[best_node + 1], np.float64), rng))


verify_typical_lossy.lossy = True  # certify refuses a session whose verifier says this


def lossy_verifier(epsilon: float = EPSILON, delta: float = DELTA) -> Callable:
    """`verify_typical_lossy` with its thresholds bound: the engine's sampled verifier under
    `decoding.lossy_typical_acceptance`. Marked `lossy` so that certify refuses it."""
    rule = functools.partial(verify_typical_lossy, epsilon=epsilon, delta=delta)
    rule.lossy = True
    return rule
