"""Draft trees: the tokens a drafter proposes, their parent links, and the one-forward verify layout.

The root is the pending token (sampled last cycle, not yet run through the target); it is NOT one of
the n nodes. Node i has parent parents[i] (-1 = child of the root) with parents[i] < i, so parents come
before children and a single left-to-right pass sees every ancestor first.

    root ── 0 ── 2          tokens  = (a, b, c, d)
         └─ 1 ── 3          parents = (-1, -1, 0, 1)      depths = (1, 1, 2, 2)

A chain is the tree with one branch; plain decoding is the empty tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass
class DraftTree:
    tokens: np.ndarray  # (n,) int64 draft tokens
    parents: np.ndarray  # (n,) int64; -1 = child of the root; parents[i] < i
    q: Optional[np.ndarray] = None  # (n, V) float64: distribution node i was drawn from (its parent's drafter dist)
    deterministic: Optional[np.ndarray] = None  # (n,) bool: point-mass node (argmax / top-k / n-gram)
    # (n,) float64: the drafter's probability of node i's path (runtime/speculation.py), where it reports one
    confidence: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        if self.q is not None:
            self.q = np.asarray(self.q, dtype=np.float64)
        if self.deterministic is None:
            # No q means nothing was sampled; with q, every node was sampled unless the drafter says otherwise.
            self.deterministic = np.full(self.tokens.shape[0], self.q is None, dtype=bool)
        else:
            self.deterministic = np.asarray(self.deterministic, dtype=bool).reshape(-1)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> np.ndarray:
        """(n,) depth of every node; children of the root have depth 1."""
        d = np.zeros(len(self), dtype=np.int64)
        for i, par in enumerate(self.parents.tolist()):
            d[i] = 1 if par < 0 else d[par] + 1
        return d

    def depth(self, i: int) -> int:
        return len(self.path(i))

    def children(self, i: int) -> List[int]:
        """Children of node i (i = -1 for the root), in index order."""
        return np.flatnonzero(self.parents == i).tolist()

    def children_lists(self) -> List[List[int]]:
        """All children at once: entry 0 is the root's children, entry i+1 node i's (one pass, for hot loops)."""
        out: List[List[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents.tolist()):
            out[par + 1].append(i)
        return out

    def path(self, i: int) -> List[int]:
        """Node indices from depth 1 down to node i, root excluded. Example (tree above): path(3) = [1, 3]."""
        if not 0 <= i < len(self):
            raise IndexError(f"node {i} out of range for a tree of {len(self)} nodes")
        return path_to(self.parents, i)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency; a drafter calls this in its tests, not per cycle."""
        n = len(self)
        if self.parents.shape != (n,):
            raise ValueError(f"parents has shape {self.parents.shape}, expected ({n},) to match tokens")
        if (self.tokens < 0).any():
            raise ValueError(f"negative token id at node {int(np.flatnonzero(self.tokens < 0)[0])}")
        idx = np.arange(n)
        bad = np.flatnonzero((self.parents < -1) | (self.parents >= idx))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"node {i} has parent {int(self.parents[i])}: parents must be -1 (root) or an earlier node")
        if self.deterministic.shape != (n,):
            raise ValueError(f"deterministic has shape {self.deterministic.shape}, expected ({n},)")
        if self.q is None:
            if not self.deterministic.all():
                raise ValueError("q is None but some nodes are marked sampled: a sampled node needs its q row")
            return
        if self.q.ndim != 2 or self.q.shape[0] != n:
            raise ValueError(f"q has shape {self.q.shape}, expected ({n}, V)")
        vocab = self.q.shape[1]
        if (self.tokens >= vocab).any():
            raise ValueError(f"token id {int(self.tokens.max())} is outside q's vocabulary of {vocab}")
        sampled = np.flatnonzero(~self.deterministic)
        if sampled.size == 0:
            return
        qs = self.q[sampled]
        if not np.isfinite(qs).all() or (qs < 0).any():
            raise ValueError("q rows of sampled nodes must be finite and non-negative")
        sums = qs.sum(axis=1)
        off = np.flatnonzero(np.abs(sums - 1.0) > 1e-6)
        if off.size:
            i = int(sampled[off[0]])
            raise ValueError(f"q row of node {i} sums to {sums[off[0]]:.6g}, expected 1")
        zero = np.flatnonzero(qs[np.arange(sampled.size), self.tokens[sampled]] <= 0)
        if zero.size:
            i = int(sampled[zero[0]])
            raise ValueError(f"node {i} was marked sampled but q gives its token {int(self.tokens[i])} probability 0")


def path_to(parents: Sequence[int], i: int) -> List[int]:
    """`DraftTree.path` on a tree still being built (its parents list so far): node indices from depth 1 down to
    node i. Example: parents (-1, -1, 0, 1) -> path_to(parents, 3) = [1, 3]."""
    out = []
    while i >= 0:
        out.append(i)
        i = int(parents[i])
    return out[::-1]


def chain(tokens: Sequence[int], q: Optional[np.ndarray] = None) -> DraftTree:
    """A k-token chain: node i is the child of node i-1. With q (k, V) the nodes are sampled, else point masses."""
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return DraftTree(tokens=toks, parents=np.arange(toks.shape[0], dtype=np.int64) - 1, q=q)


def empty_tree() -> DraftTree:
    """No draft: the verify forward runs the root alone, i.e. plain decoding."""
    return DraftTree(tokens=np.zeros(0, dtype=np.int64), parents=np.zeros(0, dtype=np.int64))


def from_choices(choices: Sequence[Sequence[int]], candidates: Sequence[np.ndarray]) -> DraftTree:
    """Medusa-style static tree. choices are paths of top-k indices per depth (root implicit);
    candidates[d] (k,) are the top-k token ids at depth d+1. Nodes are sorted by (depth, path), so
    parents precede children, and are deterministic.

    Example: choices [[1], [0], [0, 0]], candidates ([7, 9], [4, 5])
      -> sorted [[0], [1], [0, 0]] -> tokens (7, 9, 4), parents (-1, -1, 0).
    """
    paths = sorted((tuple(int(c) for c in ch) for ch in choices), key=lambda p: (len(p), p))
    index = {}
    tokens, parents = [], []
    for path in paths:
        if not path:
            raise ValueError("empty choice: the root is implicit and must not be listed")
        if path in index:
            raise ValueError(f"choice {list(path)} is listed twice")
        depth = len(path)
        if depth > len(candidates):
            raise ValueError(f"choice {list(path)} is deeper than the {len(candidates)} candidate depths given")
        cand = np.asarray(candidates[depth - 1]).reshape(-1)
        if not 0 <= path[-1] < cand.shape[0]:
            raise ValueError(f"choice {list(path)} picks index {path[-1]}, but depth {depth} has {cand.shape[0]}")
        parent = -1 if depth == 1 else index.get(path[:-1])
        if parent is None:
            raise ValueError(f"choice {list(path)} has no parent: {list(path[:-1])} is not among the choices")
        index[path] = len(tokens)
        tokens.append(int(cand[path[-1]]))
        parents.append(parent)
    return DraftTree(tokens=np.asarray(tokens, dtype=np.int64), parents=np.asarray(parents, dtype=np.int64))


def verify_inputs(tree: DraftTree, root_token: int, cache_len: int, root_position: int
                  ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """`flatten`'s tokens and positions, and its mask, or None when the tree is a chain (plain decoding's empty
    tree included): a chain's mask IS the causal one (row i sees the cache and rows 0..i), which a backend builds
    or keeps without a (T, cache_len + T) array per cycle.

    Example: root r, chain (a, b), cache_len 2, root_position 2 -> tokens (r, a, b), positions (2, 3, 4), None."""
    n = len(tree)
    if n == 0:  # a plain step (every cycle where the drafter drafts nothing): the root alone
        return np.array([root_token], np.int64), np.array([root_position], np.int64), None
    if np.array_equal(tree.parents, np.arange(-1, n - 1)):
        tokens = np.concatenate([np.asarray([root_token], dtype=np.int64), tree.tokens])  # (n+1,)
        return tokens, np.arange(root_position, root_position + n + 1, dtype=np.int64), None
    return flatten(tree, root_token, cache_len, root_position)


def flatten(
    tree: DraftTree, root_token: int, cache_len: int, root_position: int
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay out the root and the tree for ONE verify forward over a KV cache holding cache_len rows.

    Returns tokens (n+1,) int64, positions (n+1,) int64 and mask (n+1, cache_len+n+1) bool. Row 0 is the
    root, row i+1 is node i; positions = root_position + depth; every row attends to all cache rows,
    to itself and to its ancestors (root included).

    Example: root r, tree tokens (a, b, c) with parents (-1, -1, 0), cache_len 2, root_position 2:
      tokens (r, a, b, c), positions (2, 3, 3, 4),
      mask  cache | r a b c
        r    1 1  | 1 0 0 0
        a    1 1  | 1 1 0 0
        b    1 1  | 1 0 1 0
        c    1 1  | 1 1 0 1
    """
    n = len(tree)
    tokens = np.concatenate([np.asarray([root_token], dtype=np.int64), tree.tokens])  # (n+1,)
    positions = root_position + np.concatenate([[0], tree.depths()]).astype(np.int64)  # (n+1,)
    tree_mask = np.zeros((n + 1, n + 1), dtype=bool)  # row/col 0 = root
    tree_mask[0, 0] = True
    for i, par in enumerate(tree.parents.tolist()):
        tree_mask[i + 1] = tree_mask[par + 1]  # ancestors of the parent (parent row is complete: par < i)
        tree_mask[i + 1, i + 1] = True
    mask = np.concatenate([np.ones((n + 1, cache_len), dtype=bool), tree_mask], axis=1)  # (n+1, cache_len+n+1)
    return tokens, positions, mask
