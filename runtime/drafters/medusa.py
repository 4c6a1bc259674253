"""Medusa-1 heads as a drafter: K small heads on the target's last hidden state, head k guessing the token
k+1 places past the one the target itself predicts.

    h      = target final_norm hidden at the last committed position t (its lm_head gave the root x_{t+1})
    r      = ResBlock_L(...ResBlock_1(h)),  ResBlock(x) = x + SiLU(W x + b)
    q_k    = softmax(W_out_k r)             the guess for x_{t+k+2}, i.e. the tree's depth k+1

Every head reads the SAME h, so the proposal at depth d does not depend on the drafted tokens above it: a
tree is a static shape (a Medusa "choice list": paths of per-depth indices, root implicit) filled per cycle.
Greedy: depth d's candidates are the top-k tokens of head d-1 (point masses). Sampled: each node's
children are drawn from q_d by the one sibling rule (`runtime.siblings`), as many as the shape gives that
node, each child recording the proposal it was drawn from; `verify_sampled` then keeps the target's law.
Medusa's own "typical acceptance" is not used: it changes the output distribution.

Weights: the official Medusa-1 layout (`medusa_lm_head.safetensors`): `{h}.{l}.linear.weight` (H, H) and
`{h}.{l}.linear.bias` (H,) for ResBlock l < L, then `{h}.{L}.weight` (V, H), the head's own projection."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from runtime.backends.factory import load_weights
from runtime.backends.onnx_net import OnnxNet
from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec
from runtime.drafters.shared import ranking_params
from runtime.errors import BundleError
from runtime.memory.bundle_sizes import entry_numel
from runtime.memory.plan import DrafterMemory
from runtime.sampling import process_logits
from runtime.siblings import top_k
from runtime.tree import DraftTree, empty_tree, path_to

KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")
TREES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "medusa_trees.json")
Choices = List[Tuple[int, ...]]


def medusa_layout(weights: Mapping[str, np.ndarray], source: str, hidden: Optional[int] = None,
                  vocab: Optional[int] = None) -> Tuple[int, int]:
    """(num_heads, num_layers) of official Medusa-1 head weights, inferred from the keys (published configs
    can be wrong about the head count). Raises BundleError naming the first key that does not fit.

    Example: keys 0.0.linear.weight, 0.0.linear.bias, 0.1.weight, 1.0.linear.weight, 1.0.linear.bias,
    1.1.weight -> (2, 1)."""
    if not weights:
        raise BundleError(f"{source}: no tensors; expected Medusa head keys such as 0.0.linear.weight")
    layers: Dict[int, Dict[int, set]] = {}
    for key in weights:
        m = KEY.match(key)
        if m is None:
            raise BundleError(f"{source}: key {key!r} is not a Medusa-1 head key; expected {{h}}.{{l}}.linear.weight, "
                              "{h}.{l}.linear.bias (ResBlocks) or {h}.{L}.weight (the head's vocabulary projection)")
        layers.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    heads = sorted(layers)
    if heads != list(range(len(heads))):
        missing = min(set(range(max(heads) + 1)) - set(heads))
        raise BundleError(f"{source}: heads {heads} are not numbered 0..{len(heads) - 1}; no key starts with {missing}.")
    depth = None
    for h in heads:
        ls = layers[h]
        last = max(ls)
        if "weight" not in ls[last]:
            raise BundleError(f"{source}: key {h}.{last + 1}.weight missing (head {h} ends with ResBlock {h}.{last}; "
                              "its last layer must be the vocabulary projection)")
        if ls[last] != {"weight"}:
            raise BundleError(f"{source}: key {h}.{last}.weight sits beside {h}.{last}.linear.*; a layer is either a "
                              "ResBlock or the head's vocabulary projection")
        for l in range(last):
            for part in ("linear.weight", "linear.bias"):
                if part not in ls.get(l, set()):
                    raise BundleError(f"{source}: key {h}.{l}.{part} missing (ResBlock {l} of head {h})")
            if "weight" in ls[l]:
                raise BundleError(f"{source}: key {h}.{l}.weight is a vocabulary projection before ResBlock "
                                  f"{h}.{l + 1}; only the last layer of a head may be one")
        if depth is None:
            depth = last
        elif last != depth:
            raise BundleError(f"{source}: key {h}.{last}.weight: head {h} has {last} ResBlocks, head 0 has {depth}; "
                              "every head must have the same number")
    out0 = np.shape(weights[f"0.{depth}.weight"])
    if len(out0) != 2:
        raise BundleError(f"{source}: key 0.{depth}.weight has shape {out0}, expected (vocab, hidden)")
    V, H = (int(x) for x in out0)
    if hidden is not None and H != hidden:
        raise BundleError(f"{source}: key 0.{depth}.weight has hidden size {H}, the target's is {hidden}; these "
                          "heads were trained for another model")
    if vocab is not None and V != vocab:
        raise BundleError(f"{source}: key 0.{depth}.weight has {V} vocabulary rows, the target has {vocab}; these "
                          "heads were trained for another model")
    for h in heads:
        want = {f"{h}.{depth}.weight": (V, H)}
        for l in range(depth):
            want[f"{h}.{l}.linear.weight"] = (H, H)
            want[f"{h}.{l}.linear.bias"] = (H,)
        for key, shape in want.items():
            if tuple(np.shape(weights[key])) != shape:
                raise BundleError(f"{source}: key {key} has shape {tuple(np.shape(weights[key]))}, expected {shape}")
    return len(heads), depth


def standard_trees() -> Dict[str, Choices]:
    """The shipped choice lists by name (medusa_trees.json): the published Medusa trees and the zoo's own."""
    with open(TREES_FILE) as f:
        raw = json.load(f)
    return {name: [tuple(int(i) for i in p) for p in entry["choices"]] for name, entry in raw["trees"].items()}


def chain_choices(depth: int) -> Choices:
    """The top-1 chain as a choice list: [(0,), (0, 0), ...]."""
    return [(0,) * d for d in range(1, depth + 1)]


def resolve_tree(tree, depth: int) -> Choices:
    """A choice list from a name ('chain', a shipped tree) or an explicit list of paths, cut to `depth`."""
    if tree == "chain":
        return chain_choices(depth)
    if isinstance(tree, str):
        trees = standard_trees()
        if tree not in trees:
            raise BundleError(f"medusa tree {tree!r} unknown; choose 'chain' or one of {sorted(trees)} "
                              "(runtime/drafters/medusa_trees.json)")
        tree = trees[tree]
    return sorted({tuple(int(i) for i in p) for p in tree if 0 < len(p) <= depth}, key=lambda p: (len(p), p))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class MedusaDrafter(Drafter):
    kind = "medusa"
    target_taps = ("final_norm",)
    builds_sampled_trees = True
    fixed_shape = True  # the choice list is the tree; `branching` only reports its widest node

    def __init__(self, weights: Mapping[str, np.ndarray], tree="chain", num_tokens: int = 4, source: str = "medusa",
                 hidden: Optional[int] = None, vocab: Optional[int] = None, net=None):
        self.num_heads, self.num_layers = medusa_layout(weights, source, hidden, vocab)
        # net: the heads' ONNX graph (export/drafters/medusa_onnx.py) run by an OnnxNet, hidden (H,) -> (K, V);
        # then the numpy weights are not kept (the export checked the graph against them)
        self.net = net
        self.w: List[np.ndarray] = []
        self.b: List[np.ndarray] = []
        self.out = np.zeros((self.num_heads, 0, 0), np.float32)
        if net is None:
            f32 = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
            L = self.num_layers
            # stacked over heads, so that one cycle's drafting is 2 batched products per layer, not 2 per head
            self.w = [np.stack([f32[f"{h}.{l}.linear.weight"] for h in range(self.num_heads)]) for l in range(L)]  # (K, H, H)
            self.b = [np.stack([f32[f"{h}.{l}.linear.bias"] for h in range(self.num_heads)]) for l in range(L)]  # (K, H)
            self.out = np.stack([f32[f"{h}.{L}.weight"] for h in range(self.num_heads)])  # (K, V, H)
        self.choices = resolve_tree(tree, min(self.num_heads, num_tokens))
        # children per node of the shape (the root is ()): how many siblings the sibling rule draws there
        self.width: Dict[Tuple[int, ...], int] = {}
        for p in self.choices:
            self.width[p[:-1]] = max(self.width.get(p[:-1], 0), p[-1] + 1)
        self.branching = max(self.width.values(), default=1)  # widest node (certify sizes its search by it)
        self.top = [1 + max((p[d] for p in self.choices if len(p) > d), default=-1) for d in range(self.num_heads)]
        self.h: Optional[np.ndarray] = None  # (H,) final-norm hidden of the last committed position

    @property
    def memory_bytes(self) -> int:
        if self.net is not None:
            return int(self.net.weight_bytes)
        return int(self.out.nbytes + sum(w.nbytes + b.nbytes for w, b in zip(self.w, self.b)))

    def begin(self, prompt, taps, start: int = 0) -> None:
        self.h = np.asarray(taps["final_norm"][-1], np.float32)

    def accept(self, accepted_nodes, committed, taps) -> None:
        self.h = np.asarray(taps["final_norm"][-1], np.float32)

    def reset(self) -> None:
        self.h = None

    def head_logits(self, h: np.ndarray, depth: int) -> np.ndarray:
        """h (H,) -> logits of heads 0..depth-1: (depth, V)."""
        if self.net is not None:
            return self.net.run({"hidden": h}, ("logits",))["logits"][:depth]
        x = np.broadcast_to(h, (depth, h.shape[0]))  # (depth, H)
        for w, b in zip(self.w, self.b):
            x = x + silu(np.einsum("khd,kd->kh", w[:depth], x) + b[:depth])
        return np.einsum("kvh,kh->kv", self.out[:depth], x)

    def propose(self, ctx: DraftContext) -> DraftTree:
        if self.h is None or ctx.max_nodes <= 0 or not self.choices:
            return empty_tree()
        # a path of d nodes needs its d - 1 ancestors: with fewer nodes than the deepest path, the deeper heads
        # cannot place a node (a probe's 2 nodes run and rank 2 heads, the same nodes)
        depth = min(max(len(p) for p in self.choices), ctx.max_nodes)
        logits = self.head_logits(self.h, depth)  # (depth, V)
        if ctx.params.greedy:
            return self._greedy(logits, ctx)
        return self._sampled(logits, ctx)

    def _greedy(self, logits: np.ndarray, ctx: DraftContext) -> DraftTree:
        """Depth d's candidates: head d-1's top-k, ranked by its distribution at temperature 1 under the request's
        mask and penalty (point masses, so the ranking never affects exactness)."""
        soft = ranking_params(ctx.params)
        cands = [top_k(process_logits(logits[d], soft, ctx.tokens), self.top[d]).tokens for d in range(len(logits))]
        index: Dict[Tuple[int, ...], int] = {}
        tokens, parents = [], []
        for p in self.choices:
            if len(tokens) >= ctx.max_nodes:
                break
            if (len(p) > 1 and p[:-1] not in index) or p[-1] >= len(cands[len(p) - 1]):
                continue  # the mask left fewer candidates than the shape asks for (parent first: it bounds len(p))
            index[p] = len(tokens)
            tokens.append(int(cands[len(p) - 1][p[-1]]))
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        return DraftTree(tokens=np.asarray(tokens, np.int64), parents=np.asarray(parents, np.int64))

    def _sampled(self, logits: np.ndarray, ctx: DraftContext) -> DraftTree:
        """Fill the shape top-down: the children of a node are `width` draws by the sibling rule from q of the
        next depth (processed with the node's own history); a shape slot the rule did not fill (q had fewer
        tokens left) is dropped with its subtree.

        Example: shape [(0,), (1,), (0, 0)], q_1 = (0.5, 0.5, 0), q_2 = (0, 0, 1): the root's two children are
        tokens 0 and 1 in a random order (child 2 of the root would be dropped, q_1 has no mass left); the
        first child gets one child, token 2 (depth 2)."""
        params = ctx.params
        history_free = params.repetition_penalty == 1.0  # then q at a depth is the same for every node there
        shared = [process_logits(logits[d], params, ctx.tokens) for d in range(len(logits))] if history_free else None
        index: Dict[Tuple[int, ...], int] = {(): -1}
        drawn: Dict[Tuple[int, ...], object] = {}
        tokens: List[int] = []
        parents: List[int] = []
        qs: List[np.ndarray] = []
        for p in self.choices:
            if len(tokens) >= ctx.max_nodes:
                break
            parent = p[:-1]
            if parent not in index:
                continue
            if parent not in drawn:
                d = len(p) - 1
                if history_free:
                    q = shared[d]
                else:
                    q = process_logits(logits[d], params, list(ctx.tokens) + [tokens[i] for i in path_to(parents, index[parent])])
                drawn[parent] = self.sibling_rule(q, self.width[parent], ctx.rng)
            sib = drawn[parent]
            if p[-1] >= len(sib.tokens):
                continue
            index[p] = len(tokens)
            tokens.append(int(sib.tokens[p[-1]]))
            parents.append(index[parent])
            qs.append(sib.proposals[p[-1]])
        if not tokens:
            return empty_tree()
        return DraftTree(tokens=np.asarray(tokens, np.int64), parents=np.asarray(parents, np.int64),
                         q=np.stack(qs), deterministic=np.zeros(len(tokens), bool))


# -- built from a bundle entry ------------------------------------------------------------------

@dataclass(frozen=True)
class MedusaParams:
    """bundle.yaml drafters.<name>.params of Medusa heads."""
    num_heads: Optional[int] = None  # as the bundle recorded it (the weights' keys are what counts)
    tree: Any = "chain"  # 'chain', a shipped tree's name (medusa_trees.json) or a list of paths

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "MedusaParams":
        heads = d.get("num_heads")
        return MedusaParams(None if heads is None else int(heads), d.get("tree", "chain"))


def build(b: DrafterBuild, p: MedusaParams) -> MedusaDrafter:
    bundle, entry, backend = b.bundle, b.entry, b.backend
    spec = bundle.target.spec
    graph = entry.backends.get("onnx") if backend.kind == "onnx" else None  # else the numpy heads
    net = (OnnxNet(bundle.path(graph.files[0]), backend.providers, backend.threads, f"drafter {b.name}",
                   spinning=backend.spinning) if graph else None)
    return MedusaDrafter(load_weights(bundle, entry.files), tree=p.tree, num_tokens=b.num_tokens,
                         source=f"{bundle.root}: drafters.{b.name}", hidden=spec.hidden_size, vocab=spec.vocab_size,
                         net=net)


def tree_tokens(p: MedusaParams, num_tokens: int, branching: int) -> int:
    """A static tree: its size is the bundle's choice list (cut to the heads it has), not the flags'."""
    depth = min(num_tokens, p.num_heads if p.num_heads is not None else num_tokens)
    return len(resolve_tree(p.tree, depth)) + 1


def memory(bundle, entry, p: MedusaParams, backend: str) -> DrafterMemory:
    """float32 numpy heads; no cache of their own."""
    return DrafterMemory(extra_bytes=4 * entry_numel(bundle, entry))


SPEC = DrafterSpec(kinds=("medusa",), params=MedusaParams.from_dict, build=build, memory=memory,
                   tree_tokens=tree_tokens,
                   sources={"medusa": ("--medusa PATH", "heads from `edgespec train-drafter medusa --target DIR --out DIR`")})
