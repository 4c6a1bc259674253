"""Prompt-lookup drafting: match the last n tokens somewhere earlier in the context and propose what
followed there. Deterministic (point-mass nodes), costs no model; good on plans and code that repeat
the prompt's words."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Sequence

import numpy as np

from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec
from runtime.errors import BundleError
from runtime.memory.plan import NO_DRAFTER
from runtime.tree import DraftTree, empty_tree


def find_continuations(tokens: Sequence[int], max_n: int, min_n: int, k: int, branches: int) -> List[List[int]]:
    """Up to `branches` distinct continuations of length <= k following the most recent matches of the
    longest suffix n-gram (n from max_n down to min_n).

    Example: tokens (5 6 7 | 9 5 6 7 | 8 ... 5 6), max_n 2: the suffix (5 6) last occurred before 7,
    so the proposal is [7, 8, ...] (most recent match first)."""
    seq = np.asarray(tokens)
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n:]
        # windows ending before the suffix itself; most recent first
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0][::-1]
        found: List[List[int]] = []
        for start in hits:
            cont = seq[start + n:start + n + k].tolist()
            if cont and cont not in found and not any(f[:len(cont)] == cont for f in found):
                found.append(cont)
            if len(found) == branches:
                break
        if found:
            return found
    return []


def allowed_prefix(branch: Sequence[int], ctx: DraftContext) -> List[int]:
    """The longest prefix of `branch` the request's grammar allows. Example: branch (4, 9, 5) where the
    grammar forbids 9 after 4 -> [4]."""
    out: List[int] = []
    for tok in branch:
        if not ctx.mask(out)[int(tok)]:
            break
        out.append(int(tok))
    return out


def tree_from_branches(branches: Sequence[Sequence[int]]) -> DraftTree:
    """Merge token sequences into a prefix tree (shared prefixes become shared nodes)."""
    tokens: List[int] = []
    parents: List[int] = []
    index = {}
    for branch in branches:
        parent = -1
        for depth, tok in enumerate(branch):
            key = (parent, int(tok))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(parent)
            parent = index[key]
    if not tokens:
        return empty_tree()
    return DraftTree(tokens=np.asarray(tokens, np.int64), parents=np.asarray(parents, np.int64))


class NgramDrafter(Drafter):
    kind = "ngram"
    takes_branching = True

    def __init__(self, num_tokens: int = 4, max_n: int = 3, min_n: int = 1, branching: int = 1):
        self.k = num_tokens
        self.max_n = max_n
        self.min_n = min_n
        self.branching = branching

    def reusable_prefix(self, n: int) -> int:
        return n  # stateless: it reads only the context

    def propose(self, ctx: DraftContext) -> DraftTree:
        k = min(self.k, ctx.max_nodes)
        if k <= 0:
            return empty_tree()
        branches = find_continuations(ctx.tokens, self.max_n, self.min_n, k, self.branching)
        if ctx.allowed is not None:  # under a grammar: cut each branch before its first impossible token
            branches = [b for b in (allowed_prefix(b, ctx) for b in branches) if b]
        tree = tree_from_branches(branches)
        if len(tree) > ctx.max_nodes:
            tree = tree_from_branches(branches[:1])
        return tree


@dataclass(frozen=True)
class NgramParams:
    """bundle.yaml drafters.<name>.params of an n-gram drafter (all optional: it has no files)."""
    max_n: int = 3  # the longest suffix n-gram looked up
    min_n: int = 1  # the shortest

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "NgramParams":
        p = NgramParams(int(d.get("max_n", 3)), int(d.get("min_n", 1)))
        if not 1 <= p.min_n <= p.max_n:
            raise BundleError(f"{where}: min_n {p.min_n}, max_n {p.max_n}: expected 1 <= min_n <= max_n")
        return p


def build(b: DrafterBuild, p: NgramParams) -> NgramDrafter:
    return NgramDrafter(num_tokens=b.num_tokens, max_n=p.max_n, min_n=p.min_n, branching=b.branching)


SPEC = DrafterSpec(kinds=("ngram",), params=NgramParams.from_dict, build=build,
                   memory=lambda bundle, entry, p, backend: NO_DRAFTER, needs_entry=False)
