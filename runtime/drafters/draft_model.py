"""A separate small draft model (same tokenizer) proposing a chain of k tokens, or a tree of
`branching` chains that split at the first position (siblings by the one rule, `runtime.siblings`),
with its own q.

Its KV cache is a view into the same arena as the target's, so it counts against the one budget. The
cache follows the committed tokens lazily: before drafting, the longest common prefix of what the
cache holds and the context is kept and only the rest (usually the root plus a token or two) is run.
The same rule carries the draft cache across requests when the target reuses a prompt prefix.

On ONNX, with the bundle's K-step graph (export/onnx/kstep.py), a chain is drafted in ONE run: the catch-up rows,
K steps, the logits processing and the draws from uniforms of the drafter's stream. A request the graph cannot
express (a grammar, a tree, a depth beyond its K, a long catch-up) takes the step-wise path; `draft_paths`
counts which ran."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional

import numpy as np

from runtime.backends.base import TargetBackend, forward_in_chunks
from runtime.backends.factory import open_model
from runtime.backends.numpy_ref import cache_shape
from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec, common_prefix_len
from runtime.memory.plan import DrafterMemory, NO_DRAFTER, dims_from_spec
from runtime.model.bundle import BackendFiles, gguf_entries
from runtime.drafters.shared import (KSTEP, STEPWISE, grow_chains, kstep_chain, kstep_fits, kstep_memory, kstep_mode,
                                     kstep_runs, kstep_uniforms, tree_mask)
from runtime.tree import DraftTree, empty_tree, path_to



class DraftModelDrafter(Drafter):
    kind = "draft_model"
    builds_sampled_trees = True
    takes_branching = True

    def __init__(self, model: TargetBackend, num_tokens: int = 4, branching: int = 1, kstep=None):
        self.model = model
        self.kstep = kstep  # runtime/backends/onnx_kstep.OnnxKStep over `model`'s cache, or None
        self.k = num_tokens
        self.branching = branching
        self.cached: List[int] = []  # tokens whose K/V rows the draft cache holds, in order
        self._base = 0  # cache rows holding the context when the last tree was proposed
        self._node_rows: Dict[int, int] = {}  # tree node -> cache row (nodes that were run)
        self._context: List[int] = []
        self._proposed = False  # a tree was proposed and not yet accepted (a cycle may verify no tree)
        self._paths: Dict[str, int] = {KSTEP: 0, STEPWISE: 0}

    @property
    def draft_paths(self) -> Dict[str, int]:
        return dict(self._paths)

    @property
    def memory_bytes(self) -> int:
        return int(getattr(self.model, "weight_bytes", 0))

    def wrap_models(self, wrap) -> None:
        self.model = wrap(self.model)
        self.kstep = None  # the K-step graph writes the unwrapped model's cache: the wrapper would not see it

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
        if kstep_fits(ctx, self.kstep, self.branching, depth, len(context) - keep, room, self.prefill_chunk):
            return self._propose_kstep(ctx, context, keep, depth)
        self._paths[STEPWISE] += 1
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

        def run(frontier: List[int], tokens: List[int], parents: List[int], d: int) -> np.ndarray:
            """The frontier (one node per chain, depth d) in one forward under the tree mask; rows kept for accept."""
            start = self.model.cache_len
            ancestors = [[self._node_rows[a] for a in path_to(parents, n)[:-1]] for n in frontier]
            out = self._run([tokens[n] for n in frontier], [self._base + d - 1] * len(frontier),
                            tree_mask(self._base, ancestors, start))
            for j, node in enumerate(frontier):
                self._node_rows[node] = start + j
            return out

        return grow_chains(ctx, context, logits, self.branching, depth, self.sibling_rule, run)

    def _propose_kstep(self, ctx: DraftContext, context: List[int], keep: int, depth: int) -> DraftTree:
        """The chain from one run of the K-step graph (`shared.kstep_chain` cuts it as the step-wise path would)."""
        self._paths[KSTEP] += 1
        tokens, q, own = self.kstep.run(context[keep:], np.arange(keep, len(context)), ctx.params, context,
                                        kstep_uniforms(ctx, self.kstep.steps))
        self.cached = context
        self._base = len(context)
        self._context = context
        self._proposed = True
        tree = kstep_chain(ctx, tokens, q, own, depth)
        # drafted token j (< K - 1) was run at cache row base + j; the last one never is
        self._node_rows = {j: self._base + j for j in range(min(len(tree), self.kstep.steps - 1))}
        return tree

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


@dataclass(frozen=True)
class DraftModelParams:
    """bundle.yaml drafters.<name>.params of a draft model (its shape is the entry's spec, its files the entry's
    files and backends). `kstep`: draft a chain in one run of the K-step graph: "auto" (only on a GPU execution
    provider), "on", "off" (`shared.kstep_runs`)."""
    kstep: str = "auto"

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "DraftModelParams":
        return DraftModelParams(kstep=kstep_mode(d, where))


def entry_key(entry, backend) -> Optional[str]:
    """The draft model's backend entry beside the target: gguf: the GGUF of the target's quant, else its most
    precise one (a draft's quant changes the acceptance rate, never the output); None on numpy_ref."""
    if backend.kind == "numpy_ref":
        return None
    if backend.kind == "gguf":
        have = gguf_entries(entry.backends)
        return have.get(backend.precision, next(iter(have.values()), None))
    return backend.kind


def build(b: DrafterBuild, p: DraftModelParams) -> DraftModelDrafter:
    entry, backend = b.entry, b.backend
    key = entry_key(entry, backend)
    files = entry.backends.get(key) if key is not None else None
    files = files or BackendFiles(files=entry.files)
    if backend.kind != "numpy_ref" and key not in entry.backends:
        backend = replace(backend, kind="numpy_ref")  # no graph for this backend: run the draft in numpy
    cache = b.arena.allocate("draft", cache_shape(entry.spec), b.max_positions)
    model = open_model(b.bundle, entry.spec, files, backend, cache, label=f"drafter {b.name}")
    # the K-step graph drafts one chain: split chains (branching > 1) draft step-wise, so it is not opened
    kstep = kstep_graph(b.bundle, files, backend, model, p.kstep) if b.branching == 1 else None
    return DraftModelDrafter(model, num_tokens=b.num_tokens, branching=b.branching, kstep=kstep)


def kstep_graph(bundle, files: BackendFiles, backend, model, mode: str = "auto"):
    """The draft model's K-step graph (params kstep_graph / kstep_steps of its onnx entry) over `model`'s cache,
    or None: an entry without one (an older export), a GroupQueryAttention step graph, or a mode that does not run
    it on this backend (`shared.kstep_runs`)."""
    rel = files.params.get("kstep_graph")
    if not rel or getattr(model, "shared_kv", True) or not kstep_runs(mode, backend):
        return None
    from runtime.backends.onnx_kstep import OnnxKStep
    return OnnxKStep(model, bundle.path(rel), int(files.params.get("kstep_steps", 1)), providers=backend.providers,
                     threads=backend.threads, spinning=backend.spinning)


def memory(bundle, entry, p: DraftModelParams, backend: str) -> DrafterMemory:
    """Its own layers at the precision of its graph for this backend (numpy: float32)."""
    if entry.spec is None:
        return NO_DRAFTER
    d_files = entry.backends.get(backend) if backend != "numpy_ref" else None
    d_prec = d_files.params.get("precision", "fp32") if d_files is not None else "fp32"
    if d_files is not None and backend == "gguf":
        d_prec = {"f16": "fp16"}.get(d_files.params.get("quant", "f16"), d_files.params.get("quant"))
    return DrafterMemory(dims_from_spec(entry.spec), d_prec, prefill_chunked=True,
                         kstep_bytes=kstep_memory(bundle, entry, backend), kstep_mode=p.kstep, kstep_chain_only=True)


SPEC = DrafterSpec(kinds=("draft_model",), params=DraftModelParams.from_dict, build=build, memory=memory,
                   sources={"draft_model": ("--draft DIR", "a smaller model with the target's tokenizer")})
