"""The one drafter interface. Every drafter (n-gram, draft model, MTP, Medusa, EAGLE, DFlash)
implements it, so the engine never branches on the drafter's kind.

A cycle, seen from the drafter:
  1. `propose(ctx)` -> a DraftTree continuing after ctx.tokens[-1] (the root: the last emitted token,
     which the target has not run yet).
     Under a grammar, `ctx.mask(path)` gives the tokens allowed after the root + `path` (the drafted
     tokens above a node); pass it to `process_logits` so that q never proposes an impossible token.
     Exactness does not depend on it (the verifier masks p by each node's path, and any q the drafter
     truly drew from is verified exactly); it only keeps verify rows from being wasted.
  2. The target verifies the tree; `accept(accepted_nodes, committed, taps)` tells the drafter which
     tree nodes were accepted, the tokens now committed to the target's KV cache (root + accepted
     tokens) and the target's hidden taps at those positions (rows aligned with `committed`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.base import PREFILL_CHUNK
from runtime.sampling import SamplingParams
from runtime.siblings import draw_siblings
from runtime.tree import DraftTree


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class DraftContext:
    tokens: Sequence[int]  # prompt + emitted tokens; tokens[-1] is the root of the tree to propose
    params: SamplingParams  # the request's sampling: drafters apply the SAME processing to q
    rng: np.random.Generator  # the drafter's own stream (sampled drafts)
    max_nodes: int  # at most this many nodes (what is left of the context budget)
    # The request's grammar (runtime/text/grammar.py): path after the root -> (V,) bool allowed mask; None = none.
    allowed: Optional[Callable[[Sequence[int]], np.ndarray]] = None

    def mask(self, path: Sequence[int] = ()) -> Optional[np.ndarray]:
        """(V,) bool: the tokens the grammar allows after root + `path`; None when the request has no grammar.

        Example: a JSON-list grammar, nothing emitted yet: mask(()) allows only tokens starting with '['."""
        return None if self.allowed is None else self.allowed(path)


class Drafter:
    kind: str = "base"
    target_taps: Tuple[str, ...] = ()  # target hidden taps the drafter reads; the engine requests them
    # How a tree-building drafter samples several children of one node (runtime/siblings.py). Drafters
    # must take sampled siblings only through this, so that each node's q is what the verifier needs.
    sibling_rule: Callable = staticmethod(draw_siblings)
    builds_sampled_trees: bool = False  # True where `branching` > 1 gives sampled siblings (certify tests them)
    # True where the tree's shape is the drafter's own data (Medusa's choice list), not set by `branching`:
    # certify then tests that one shape instead of re-setting `branching`
    fixed_shape: bool = False
    # Rows per forward where the drafter catches up on a long prompt with its own model (draft model, EAGLE):
    # the engine sets it to its memory.prefill_chunk, so the drafter's scratch is bounded like the target's.
    prefill_chunk: int = PREFILL_CHUNK

    def begin(self, prompt: Sequence[int], taps: Dict[str, np.ndarray], start: int = 0) -> None:
        """A new request: the target has just prefilled `prompt`. With `start` > 0 (only after
        `reusable_prefix` allowed it) the target kept its rows [0, start) from the previous request (the
        same tokens at the same positions) and ran the rest: taps rows align with prompt[start:]. The
        engine passes `start` only when it is > 0."""

    def reusable_prefix(self, n: int) -> int:
        """The target could keep its first `n` cache rows from the previous request (prompt prefix cache):
        how many of them may it keep, given this drafter's own state? `begin` then gets that `start`.
        0 (the default) makes the target prefill the whole prompt and `begin` start afresh: the safe
        answer for a drafter that keeps state or reads target taps and has not been taught otherwise."""
        return 0

    def propose(self, ctx: DraftContext) -> DraftTree:
        raise NotImplementedError

    def accept(self, accepted_nodes: Sequence[int], committed: Sequence[int], taps: Dict[str, np.ndarray]) -> None:
        """The verify result of the last proposal (see the module docstring)."""

    def reset(self) -> None:
        """Forget the request (free the drafter's KV rows)."""

    @property
    def memory_bytes(self) -> int:
        """Bytes the drafter holds beyond the shared KV arena (weights)."""
        return 0
