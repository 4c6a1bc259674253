"""Exact verification of a draft tree against the target's processed distributions.

target_probs (n+1, V): row 0 is the target's distribution after the root (the pending token), row i+1 its
distribution after node i. Every rule here is lossless: the emitted tokens are distributed exactly as if
they had been sampled from the target one at a time (greedy: exactly the target's argmax sequence).
Tokens emitted by one cycle = tree.tokens[result.accepted] + [result.next_token].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from runtime.sampling import sample
from runtime.tree import DraftTree


@dataclass
class VerifyResult:
    accepted: List[int]  # node indices along the accepted path (root excluded), in depth order
    next_token: int  # the target's token after the accepted path: a correction or a bonus


def acceptance_probability(p: np.ndarray, q: np.ndarray) -> float:
    """Probability that x ~ q is accepted against p: sum_x min(p(x), q(x)).

    Example: p = (0.6, 0.3, 0.1), q = (0.3, 0.3, 0.4) -> 0.3 + 0.3 + 0.1 = 0.7.
    """
    return float(np.minimum(np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)).sum())


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Distribution to sample after rejecting a draw from q: norm(max(0, p - q)).

    Example: p = (0.6, 0.3, 0.1), q = (0.3, 0.3, 0.4) -> max(0, p - q) = (0.3, 0, 0) -> (1, 0, 0).
    When p <= q everywhere (i.e. p == q) a rejection has probability 0 and the residual is undefined;
    float round-off can still reject, so p itself is returned rather than dividing by zero.
    """
    p = np.asarray(p, dtype=np.float64)
    r = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)
    total = r.sum()
    if not total > 0.0:
        return p / p.sum()
    return r / total


def _check_shapes(tree: DraftTree, target_probs: np.ndarray) -> np.ndarray:
    probs = np.asarray(target_probs)
    n = len(tree)
    if probs.ndim != 2 or probs.shape[0] != n + 1:
        raise ValueError(f"target_probs has shape {probs.shape}, expected ({n + 1}, V) for a tree of {n} nodes")
    return probs


def verify_greedy(tree: DraftTree, target_probs: np.ndarray) -> VerifyResult:
    """Greedy: walk from the root taking the first child (index order) whose token is the target's argmax
    at the current row; stop when none matches; next_token = argmax of the last accepted row.
    Rows may be one-hot or full distributions; only their argmax (ties -> lowest id) is used.

    Example: chain (5, 7, 2), argmaxes by row (5, 7, 9, 4) -> accepted [0, 1], next_token 9 (the correction).
    Tree tokens (3, 5) both children of the root, argmax row 0 = 5 -> accepted [1], next_token = argmax row 2.
    """
    probs = _check_shapes(tree, target_probs)
    return verify_greedy_choices(tree, np.argmax(probs, axis=1))


def verify_greedy_choices(tree: DraftTree, choices: np.ndarray) -> VerifyResult:
    """verify_greedy from the target's argmax per row, choices (n+1,) int (sampling.greedy_choices of the raw
    logits when nothing processes them): the same walk, without an (n+1, V) distribution.

    Example: chain (5, 7, 2), choices (5, 7, 9, 4) -> accepted [0, 1], next_token 9."""
    n = len(tree)
    if len(choices) != n + 1:
        raise ValueError(f"{len(choices)} target choices, expected {n + 1} for a tree of {n} nodes")
    if n == 0:  # plain decoding's cycle: the root's row is the next token
        return VerifyResult(accepted=[], next_token=int(choices[0]))
    argmax = np.asarray(choices).tolist()  # (n+1,) target's choice after root / node i
    kids = tree.children_lists()
    tokens = tree.tokens.tolist()
    accepted: List[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        match = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if match is None:
            return VerifyResult(accepted=accepted, next_token=int(want))
        accepted.append(match)
        node = match


def verify_sampled(tree: DraftTree, target_probs: np.ndarray, rng: np.random.Generator) -> VerifyResult:
    """Recursive rejection sampling (SpecInfer multi-step / EAGLE): exact for chains and trees.

    At a node with children c1..cm (index order), start from p = that node's target row. For each child
    with token x and proposal q (one-hot(x) if deterministic, else tree.q[c]): accept with probability
    min(1, p(x) / q(x)) using one rng.random() draw; if accepted, recurse into the child; if rejected,
    p <- norm(max(0, p - q)) and try the next child. If every child is rejected, next_token ~ p (the
    final residual). A node without children emits a bonus token ~ its own row.

    Exactness needs each sampled child's token to be drawn from the q recorded for it, given the path
    above it and its earlier siblings, and independently of the verification coins. Every tree-building
    drafter takes its siblings from `runtime.siblings` (distinct draws without replacement, child i's q =
    the parent's q without the earlier siblings, renormalised), so this holds by construction; i.i.d.
    siblings with duplicates kept also satisfy it. Dropping duplicates of i.i.d. draws does NOT: it skips
    a rejection that would have moved the residual. A point mass (top-k, argmax, n-gram) is accepted
    with probability p(x), and on rejection x is zeroed in p.

    Example: one sampled child x = 0 drawn from q = (0.3, 0.3, 0.4) with p = (0.6, 0.3, 0.1):
    accept with min(1, 0.6 / 0.3) = 1. Had x = 2, accept with 0.1 / 0.4 = 0.25; on rejection the
    correction is drawn from residual(p, q) = (1, 0, 0), i.e. token 0.
    """
    probs = _check_shapes(tree, target_probs)
    kids = tree.children_lists()
    tokens = tree.tokens.tolist()
    deterministic = tree.deterministic.tolist()
    accepted: List[int] = []
    node = -1
    while True:
        p = np.array(probs[node + 1], dtype=np.float64)  # private copy: rejections rewrite it
        chosen = None
        for c in kids[node + 1]:
            x = tokens[c]
            u = rng.random()
            if deterministic[c]:
                if u < p[x]:
                    chosen = c
                    break
                p[x] = 0.0  # residual of a point mass: p with x removed
                total = p.sum()
                # A rejection means p(x) < 1, so mass remains; the guard covers round-off only.
                p = p / total if total > 0.0 else np.array(probs[node + 1], dtype=np.float64)
            else:
                if tree.q is None:
                    raise ValueError(f"node {c} is marked sampled but the tree has no q")
                q = tree.q[c]
                qx = q[x]
                if not qx > 0.0:
                    raise ValueError(
                        f"node {c} was sampled with q(token {x}) = {qx}: a drafter bug (it drew an impossible token)")
                if u * qx < p[x]:  # u < p(x)/q(x) without the division
                    chosen = c
                    break
                # Rejection has probability sum max(0, p - q), so max(0, p - q) has positive mass
                # whenever a rejection can happen; `residual` guards the round-off case.
                p = residual(p, q)
        if chosen is None:
            return VerifyResult(accepted=accepted, next_token=sample(p, rng))
        accepted.append(chosen)
        node = chosen
