"""Prompt-lookup drafting: match the last n tokens somewhere earlier in the context and propose what
followed there. Deterministic (point-mass nodes), costs no model; good on plans and code that repeat
the prompt's words."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Sequence, Tuple

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


class NgramIndex:
    """`find_continuations` over a growing context without scanning it: the start positions of every n-gram
    (n = min_n .. max_n), kept as tokens are appended, so a proposal costs a dictionary lookup (the scan cost
    40-60 µs a cycle here at 60-250 tokens, ~10 % of a zoo step and most of what a proposal that finds nothing
    costs; the adaptive rule counts that cost against the template).

    >>> idx = NgramIndex(max_n=2, min_n=1)
    >>> idx.continuations([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], k=3, branches=1)
    ([[7, 8, 5]], 2)"""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: List[int] = []
        self.starts: Dict[Tuple[int, ...], List[int]] = {}  # n-gram -> its start positions, rising

    def sync(self, tokens: Sequence[int]) -> None:
        """Index `tokens`: appended to what is indexed when they extend it (a decode's context), else afresh."""
        have = len(self.tokens)
        if len(tokens) < have or list(tokens[:have]) != self.tokens:
            self.tokens, self.starts, have = [], {}, 0
        new = [int(t) for t in tokens[have:]]
        self.tokens.extend(new)
        toks = self.tokens
        for end in range(have, len(toks)):
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    self.starts.setdefault(tuple(toks[end - n + 1:end + 1]), []).append(end - n + 1)

    def continuations(self, tokens: Sequence[int], k: int, branches: int) -> Tuple[List[List[int]], int]:
        """(find_continuations(tokens, max_n, min_n, k, branches), the n of the suffix they follow; 0: none)."""
        self.sync(tokens)
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            found: List[List[int]] = []
            for start in reversed(self.starts.get(tuple(toks[length - n:]), ())):
                if start + n > length - 1:  # the suffix itself (a window must end before the last token)
                    continue
                cont = toks[start + n:start + n + k]
                if cont and cont not in found and not any(f[:len(cont)] == cont for f in found):
                    found.append(cont)
                if len(found) == branches:
                    break
            if found:
                return found, n
        return [], 0


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
        self._index = NgramIndex(max_n, min_n)  # its only state: a cache of the context's n-grams

    def reusable_prefix(self, n: int) -> int:
        return n  # it reads only the context (the index follows whatever context it is given)

    def confidence(self, n: int) -> float:
        """Each proposed token's own confidence: the matched suffix's length n over max_n + 1 (a 3-token match is a
        stronger cue than a 1-token one; the adaptive rule's calibration learns what each is worth in acceptance).

        >>> NgramDrafter(max_n=3).confidence(3), NgramDrafter(max_n=3).confidence(1)
        (0.75, 0.25)"""
        return n / (self.max_n + 1)

    def propose(self, ctx: DraftContext) -> DraftTree:
        k = min(self.k, ctx.max_nodes)
        if k <= 0:
            return empty_tree()
        branches, n = self._index.continuations(ctx.tokens, k, self.branching)
        if ctx.allowed is not None:  # under a grammar: cut each branch before its first impossible token
            branches = [b for b in (allowed_prefix(b, ctx) for b in branches) if b]
        if len(branches) == 1 and ctx.stop is not None:  # a chain: kept while the rule says its nodes pay
            own = [self.confidence(n)] * len(branches[0])
            branches = [branches[0][:ctx.stop.keep_chain([None] * len(own), own, True)]]
        if len(branches) == 1 and branches[0]:  # a chain (most proposals), built at once
            chain = branches[0][:ctx.max_nodes]
            depth = np.arange(1, len(chain) + 1)
            # path confidence: the own confidence to the node's depth
            conf = self.confidence(n) ** depth.astype(np.float64) if ctx.wants_confidence else None
            return DraftTree(tokens=np.asarray(chain, np.int64), parents=depth - 2, confidence=conf)
        tree = tree_from_branches(branches)
        if len(tree) > ctx.max_nodes:
            tree = tree_from_branches(branches[:1])
        if ctx.wants_confidence and len(tree):
            tree = replace(tree, confidence=self.confidence(n) ** tree.depths().astype(np.float64))
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
