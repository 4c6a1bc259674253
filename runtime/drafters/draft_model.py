"""A separate small draft model (same tokenizer) proposing a chain of k tokens, or a tree of
`branching` chains that split at the first position (siblings by the one rule, `runtime.siblings`),
with its own q.

Its KV cache is a view into the same arena as the target's, so it counts against the one budget. The
cache follows the committed tokens lazily: before drafting, the longest common prefix of what the
cache holds and the context is kept and only the rest (usually the root plus a token or two) is run.
The same rule carries the draft cache across requests when the target reuses a prompt prefix."""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from runtime.backends.base import TargetBackend, forward_in_chunks
from runtime.drafters.base import DraftContext, Drafter, common_prefix_len
from runtime.drafters.shared import pick_children
from runtime.sampling import process_logits, sample
from runtime.tree import DraftTree, empty_tree


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    builds_sampled_trees = True

    def __init__(self, model: TargetBackend, num_tokens: int = 4, branching: int = 1):
        self.model = model
        self.k = num_tokens
        self.branching = branching
        self.cached: List[int] = []  # tokens whose K/V rows the draft cache holds, in order
        self._base = 0  # cache rows holding the context when the last tree was proposed
        self._node_rows: Dict[int, int] = {}  # tree node -> cache row (nodes that were run)
        self._context: List[int] = []
        self._proposed = False  # a tree was proposed and not yet accepted (a cycle may verify no tree)

    @property
    def memory_bytes(self) -> int:
        return int(getattr(self.model, "weight_bytes", 0))

    def begin(self, prompt, taps, start: int = 0) -> None:
        if not start:
            self.reset()
        # else: the target kept a prefix; `propose` keeps what the draft cache shares with the context

    def reusable_prefix(self, n: int) -> int:
        return n  # reads no target taps

    def reset(self) -> None:
        self.model.reset()
        self.cached = []
        self._proposed = False

    def _run(self, tokens, positions, mask=None) -> np.ndarray:
        return self.model.forward(np.asarray(tokens, np.int64), np.asarray(positions, np.int64), mask).logits

    def propose(self, ctx: DraftContext) -> DraftTree:
        context = list(ctx.tokens)
        keep = min(common_prefix_len(self.cached, context), len(context) - 1, self.model.cache_len)
        self.model.keep(keep, [])
        self.cached = self.cached[:keep]  # (set again below; right also if the forward fails)
        room = self.model.max_cache_len - len(context)  # rows left for drafted nodes
        depth = min(self.k, ctx.max_nodes // self.branching, 1 + room // self.branching)
        # (a new prompt: in chunks, like the target's prefill; after a cycle only the root and a token or two)
        logits = forward_in_chunks(self.model, context[keep:], np.arange(keep, len(context)), (), self.prefill_chunk,
                                   all_logits=False).logits[-1]
        self.cached = context
        self._base = len(context)
        self._node_rows = {}
        self._context = context
        self._proposed = True
        if depth <= 0:
            return empty_tree()
        params = ctx.params
        mask0 = ctx.mask(())
        q0 = process_logits(logits, params, context, mask0)
        firsts = pick_children(logits, q0, params, context, self.branching, ctx.rng, self.sibling_rule, mask0)
        deterministic = firsts.deterministic
        tokens: List[int] = firsts.tokens.tolist()
        parents: List[int] = [-1] * len(tokens)
        qs: List[np.ndarray] = [q0] * len(tokens) if deterministic else list(firsts.proposals)
        frontier = list(range(len(tokens)))  # node index of each chain's last token
        for d in range(1, depth):
            # Run the frontier (one node per chain) in one forward with a tree mask, then extend each chain.
            start = self.model.cache_len
            rows_mask = np.zeros((len(frontier), start + len(frontier)), bool)
            for j, node in enumerate(frontier):
                rows_mask[j, :self._base] = True
                for anc in self._path(parents, node)[:-1]:
                    rows_mask[j, self._node_rows[anc]] = True
                rows_mask[j, start + j] = True
            out = self._run([tokens[n] for n in frontier], [self._base + d - 1] * len(frontier), rows_mask)
            for j, node in enumerate(frontier):
                self._node_rows[node] = start + j
            new_frontier = []
            for j, node in enumerate(frontier):
                path = [tokens[a] for a in self._path(parents, node)]
                q = process_logits(out[j], params, context + path, ctx.mask(path))
                t = int(np.argmax(q)) if params.greedy else sample(q, ctx.rng)
                new_frontier.append(len(tokens))
                tokens.append(t)
                parents.append(node)
                qs.append(q)
            frontier = new_frontier
        tree = DraftTree(tokens=np.asarray(tokens, np.int64), parents=np.asarray(parents, np.int64),
                         q=None if deterministic else np.stack(qs),
                         deterministic=np.full(len(tokens), deterministic))
        return tree

    @staticmethod
    def _path(parents: Sequence[int], node: int) -> List[int]:
        path = []
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def accept(self, accepted_nodes, committed, taps) -> None:
        if not self._proposed:  # the engine verified no tree this cycle (one token left): the cache stands as is
            return
        self._proposed = False
        rows = []
        for node in accepted_nodes:
            if node not in self._node_rows:
                break  # the deepest accepted token was never run; the next propose catches it up
            rows.append(self._node_rows[node])
        self.model.keep(self._base, rows)
        self.cached = self._context + [int(t) for t in committed[1:1 + len(rows)]]
