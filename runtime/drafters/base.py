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
     Plain steps the adaptive rule runs as a run (runtime/decode/engine.py PlainRun) are told in ONE
     accept at the run's end: no node accepted, `committed` the run's roots, `taps` a row each; a
     drafter that reads no taps is not told of them at all (its next `propose` sees the whole context).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.base import PREFILL_CHUNK
from runtime.backends.factory import load_weights
from runtime.config import BackendConfig
from runtime.memory.kv import CacheShape, KVArena
from runtime.memory.plan import DrafterMemory
from runtime.sampling import SamplingParams
from runtime.siblings import draw_siblings
from runtime.speculation import NodeRule
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
    # Per-node early stopping (runtime.speculation.NodeRule): a drafter keeps a node only while rule.pays(...);
    # None = draft the whole shape. It sees only what the drafter knows, never the target's outputs.
    stop: Optional[NodeRule] = None
    record_confidence: bool = False  # report each node's path confidence (DraftTree.confidence) for calibration

    @property
    def wants_confidence(self) -> bool:
        return self.stop is not None or self.record_confidence

    def mask(self, path: Sequence[int] = ()) -> Optional[np.ndarray]:
        """(V,) bool: the tokens the grammar allows after root + `path`; None when the request has no grammar.

        Example: a JSON-list grammar, nothing emitted yet: mask(()) allows only tokens starting with '['."""
        return None if self.allowed is None else self.allowed(path)


class Drafter:
    kind: str = "base"
    target_taps: Tuple[str, ...] = ()  # target hidden taps the drafter reads; the engine requests them
    # The tree's width: children of the root (a drafter whose tree is its own data reports its widest node).
    # 1 = a chain. Certify sizes its power control by it.
    branching: int = 1
    takes_branching: bool = False  # True where `branching` is a knob of the drafter (certify re-sets it)
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
        engine always passes `start` (0 = a fresh request)."""

    def set_branching(self, width: int) -> None:
        """Draft trees `width` wide from the next proposal on (certify tests several widths on one session)."""
        if not self.takes_branching:
            raise ValueError(f"drafter {self.kind!r} has no branching to set (its trees are its own)")
        self.branching = int(width)

    def wrap_models(self, wrap: Callable) -> None:
        """Replace each model the drafter runs like a target (a draft model) by wrap(model): certify memoises
        them. Drafters with heads of their own run no such model: nothing to do."""

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

    @property
    def draft_paths(self) -> Dict[str, int]:
        """Proposals so far per drafting path, for a drafter with more than one (one with a K-step graph: the draft
        model, an EAGLE-1/3 chain, a single MTP module: "kstep", one graph run per chain, or "stepwise", a forward
        per token); {} for a drafter with one path."""
        return {}


# -- how a drafter kind is built from a bundle entry (runtime/drafters/registry.py lists the kinds) ------------

@dataclass
class DrafterBuild:
    """What building one drafter needs: the bundle entry and the session's arena, backend and flags."""
    name: str  # the entry's name in bundle.yaml (eagle3_chain, dflash_b8, ...; "ngram" may have no entry)
    entry: Any  # runtime.model.bundle.DrafterEntry, or None (an n-gram drafter without an entry)
    bundle: Any  # runtime.model.bundle.Bundle
    backend: BackendConfig
    arena: KVArena
    max_positions: int  # context rows of the target's cache
    num_tokens: int  # draft depth (drafter.num_tokens)
    branching: int  # drafter.branching
    target_weights: Optional[Mapping[str, np.ndarray]] = None  # the target's numpy weights, when loaded already

    @property
    def source(self) -> str:
        return f"{self.bundle.root}: drafters.{self.name}"

    def target_numpy_weights(self) -> Mapping[str, np.ndarray]:
        if self.target_weights is not None:
            return self.target_weights
        return load_weights(self.bundle, self.bundle.target_files("numpy_ref").files)

    def embed_and_head(self) -> Tuple[np.ndarray, np.ndarray]:
        """The target's embedding (V, H) and LM head (V, H) as float32 (the head is the embedding when tied)."""
        target_w = self.target_numpy_weights()
        embed = np.ascontiguousarray(target_w["model.embed_tokens.weight"], np.float32)
        tied = self.bundle.target.spec.tie_word_embeddings
        return embed, embed if tied else np.ascontiguousarray(target_w["lm_head.weight"], np.float32)


def draft_cache_shapes(entry, params, target_spec) -> Dict[str, CacheShape]:
    """The cache of a drafter with decoder layers of its own (entry.spec): one row per position, its shape."""
    if entry is None or entry.spec is None:
        return {}
    return {"draft": CacheShape(entry.spec.num_layers, entry.spec.num_kv_heads, entry.spec.head_dim)}


def split_chains_tree_tokens(params, num_tokens: int, branching: int) -> int:
    """Tokens of the largest verify forward: `branching` chains of `num_tokens`, plus the root."""
    return num_tokens * branching + 1


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter kind as the rest of the runtime sees it; each runtime/drafters/<name>.py declares its SPEC.

    Session builds drafters, the memory plan sizes them and certify tests them through these functions only,
    so that nothing outside a drafter's own file switches on its kind."""
    kinds: Tuple[str, ...]  # the bundle entry kinds it builds (bundle.yaml drafters.<name>.kind)
    params: Callable[[Mapping, str], Any]  # entry.params, "where" -> the kind's typed params dataclass
    build: Callable[[DrafterBuild, Any], Drafter]  # (build, params) -> the drafter
    # bundle entry -> bytes the drafter holds beyond the target (runtime/memory/plan.py DrafterMemory)
    memory: Callable[[Any, Any, Any, str], DrafterMemory]  # (bundle, entry, params, backend kind)
    cache_shapes: Callable[[Any, Any, Any], Dict[str, CacheShape]] = draft_cache_shapes  # (entry, params, target spec)
    tree_tokens: Callable[[Any, int, int], int] = split_chains_tree_tokens  # (params, num_tokens, branching)
    needs_entry: bool = True  # False: the kind runs with default params when the bundle has no entry for it
    # kind -> (the `edgespec bundle` flag that adds an entry of it, what the flag takes); flag None: `what` says
    # where such a drafter comes from. The message for a drafter a bundle lacks (registry.missing_drafter).
    sources: Mapping[str, Tuple[Optional[str], str]] = field(default_factory=dict)
