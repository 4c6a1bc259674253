"""EAGLE heads as drafters: EAGLE-1 (chains), EAGLE-2 (EAGLE-1 weights + a dynamic draft tree), EAGLE-3.

One draft decoder layer runs over (feature f_t, token x_{t+1}) at rotary position t and predicts x_{t+2}:

    EAGLE-1   x   = fc(concat[embed(x_{t+1}), f_t])               f_t = the target's final-normed hidden
              h'  = layer(x) with no input norm                    q = softmax(target_lm_head(h'))
    EAGLE-3   f_t = fc(concat[in_2, in_{N//2}, in_{N-3}])          in_i = the hidden ENTERING target layer i
              h'  = x + attn(concat[input_layernorm(embed(x_{t+1})), hidden_norm(f_t)]), then the MLP half
                    (x = f_t, or hidden_norm(f_t) when norm_before_residual)
              q   = softmax(lm_head(norm(h'))) over the draft vocabulary, placed at target ids d + d2t[d]

Deeper draft positions feed the layer's own output h' back as the feature. The drafter keeps its own
one-layer KV cache (a view into the shared arena): rows [0, committed) belong to committed tokens and were
computed from the TARGET's features; each cycle runs only the rows of newly committed positions, then
drafts on temporary rows that `accept` drops.

Trees. `tree=None`: chains of `num_tokens` (argmax when greedy, sampled with q recorded otherwise), split
at the root into `branching` children by the one sibling rule (`runtime.siblings`). `tree=DynamicTree`:
the EAGLE-2 tree (see `dynamic_tree`), whose nodes are deterministic top-k picks, i.e. point masses, at
any temperature: the verifier accepts x with p(x), and on rejection zeroes x in p."""
from __future__ import annotations

import math

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.factory import load_weights
from runtime.backends.numpy_ref import cache_shape
from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec
from runtime.drafters.heads import HeadRunner, head_graphs, head_kstep
from runtime.drafters.shared import (KSTEP, STEPWISE, grow_chains, kstep_chain, kstep_fits, kstep_memory, kstep_mode,
                                     kstep_uniforms, ranking_params, tree_mask)
from runtime.errors import BundleError
from runtime.memory import plan as memory_plan
from runtime.memory.bundle_sizes import target_embedding_copy_bytes
from runtime.memory.kv import KVCache
from runtime.model.layers import causal_mask, decoder_layer, rms_norm, rope_cos_sin, rope_inv_freq
from runtime.model.spec import ModelSpec
from runtime.sampling import process_logits
from runtime.siblings import top_k
from runtime.tree import DraftTree, empty_tree, path_to

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")
UNMAPPED = np.float32(-1e30)  # logit of target ids outside an EAGLE-3 draft vocabulary: probability 0, never NaN


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic draft tree (the paper's defaults: total_tokens 60, depth 6 levels, top_k 10)."""
    total_tokens: int = 60  # nodes kept after the final rerank (the root not counted)
    depth: int = 6  # levels below the root
    top_k: int = 10  # children per expanded node, and nodes expanded per level

    @staticmethod
    def from_params(d: Mapping, source: str) -> "DynamicTree":
        tree = DynamicTree(**{k: d[k] for k in ("total_tokens", "depth", "top_k") if k in d})
        for k in ("total_tokens", "depth", "top_k"):
            v = getattr(tree, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BundleError(f"{source}: tree.{k}: got {v!r}, expected an integer >= 1")
        return tree


def dynamic_tree(expand, root_scores: np.ndarray, tree: DynamicTree, max_nodes: int,
                 stop=None) -> Tuple[List[int], List[int], List[float]]:
    """EAGLE-2's tree from drafter log-probabilities: take the root's top_k children; then, `depth - 1` times,
    expand every frontier node into its top_k children, record all of them, and make the top_k of this
    level's children by CUMULATIVE log-probability (the log-probability of the path) the next frontier.
    Finally rerank every recorded node by that score and keep the best `total_tokens` (and at most
    `max_nodes`). A child never scores above its parent, and ties go to the earlier-created node, so the
    kept set holds every kept node's parent; nodes keep creation order, so parents precede children.

    `expand(nodes, tokens, parents)` runs the draft layer on those frontier nodes (tokens / parents: every
    node created so far) and returns their (len(nodes), V) log-probability rows. Returns (tokens, parents, path
    confidences exp(score)) with parents as indices into the returned nodes.

    Example, top_k 2, depth 2, total_tokens 3: root log-probs a -0.1, b -2.5 -> nodes a, b; expanding them
    gives a:(c -0.2, d -3.0), b:(e -0.1, f -0.5) -> cumulative c -0.3, d -3.1, e -2.6, f -3.0. Ranked: a -0.1,
    c -0.3, b -2.5, e -2.6 ... -> keep a, b, c: tokens (a, b, c), parents (-1, -1, 0).

    With a budget below top_k or depth (max_nodes, total_tokens), only the best `budget` children of a node and
    of a level are made, over at most `budget` levels: the same tree for a fraction of the runs.

    `stop` (runtime.speculation.NodeRule): the tree gets the nodes it earns: the reranked nodes are kept while
    the calibrated acceptance of their path (confidence exp(score)) pays for one more verify row, and a level is
    not expanded when not even a certain child of its best node could pay. Every node is a point mass (a
    function of the drafter's state), so deciding by its own score keeps verification exact.
    """
    tokens: List[int] = []
    parents: List[int] = []
    scores: List[float] = []

    def children_of(parent: int, logp: np.ndarray, base: float) -> List[int]:
        picked = top_k(np.exp(logp), tree.top_k).tokens  # positive probability only
        made = []
        for t in picked.tolist():
            made.append(len(tokens))
            tokens.append(int(t))
            parents.append(parent)
            scores.append(base + float(logp[t]))
        return made

    budget = min(tree.total_tokens, max_nodes)
    # A kept node's ancestors are kept too and every better sibling or level-mate ranks before it, so the best
    # `budget` nodes lie within `budget` levels and within the best `budget` children of a node and of a level:
    # a smaller budget (a probe's 2 nodes) expands only those, and keeps the very tree the full search would.
    tree = replace(tree, top_k=min(tree.top_k, budget), depth=min(tree.depth, budget))
    frontier = children_of(-1, root_scores, 0.0)
    floor = min(stop.margin(n) for n in range(max(1, budget))) if stop else 0.0
    for _ in range(tree.depth - 1):
        if not frontier or (stop is not None and stop.fixed_gain(math.exp(scores[frontier[0]])) < floor):
            break
        rows = expand(frontier, tokens, parents)
        level: List[int] = []
        for node, logp in zip(frontier, rows):
            level += children_of(node, logp, scores[node])
        frontier = sorted(level, key=lambda n: (-scores[n], n))[:tree.top_k]
    keep = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:budget]
    if stop is not None:  # best first, so the kept nodes stay a prefix of the ranking (parents before children)
        paying = [stop.pays(stop.fixed_gain(math.exp(scores[n])), i) for i, n in enumerate(keep)]
        keep = keep[:paying.index(False) if False in paying else len(keep)]
    keep.sort()
    index = {n: i for i, n in enumerate(keep)}
    return ([tokens[n] for n in keep], [index[parents[n]] if parents[n] >= 0 else -1 for n in keep],
            [math.exp(scores[n]) for n in keep])


class EagleDrafter(Drafter):
    builds_sampled_trees = True  # chains split at the root by the sibling rule when branching > 1
    takes_branching = True  # the chains' split (the EAGLE-2 tree keeps its own shape)

    def __init__(self, kind: str, spec: ModelSpec, weights: Mapping[str, np.ndarray], embed: np.ndarray,
                 target_head: np.ndarray, cache: KVCache, params: Mapping, num_tokens: int = 4, branching: int = 1,
                 tree: Optional[DynamicTree] = None, source: str = "eagle", net=None, kstep=None):
        if kind not in ("eagle", "eagle3"):
            raise BundleError(f"{source}: kind {kind!r} is not an EAGLE head")
        self.kind = kind
        self.spec = spec
        self.cache = cache
        self.k = num_tokens
        self.branching = branching
        self.tree = tree
        if tree is not None:
            self.builds_sampled_trees = False  # dynamic trees are point masses at every temperature
        p = "layers.0." if kind == "eagle" else "midlayer."
        need = ["fc.weight"] + [p + k for k in LAYER_KEYS]
        if kind == "eagle" and params.get("bias", True):
            need.append("fc.bias")
        if kind == "eagle3":
            need += [p + "input_layernorm.weight", p + "hidden_norm.weight", "norm.weight", "lm_head.weight"]
        if spec.qkv_bias:
            need += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        missing = [n for n in need if n not in weights]
        if missing:
            raise BundleError(f"{source}: missing weights {missing[:3]}; rebuild the bundle's {kind} drafter "
                              "(export/drafters/eagle.py)")
        if net is not None:  # the graph holds the layer and head: keep only what runs outside it, the EAGLE-3 fc
            need = ["fc.weight"] if kind == "eagle3" else []
        self.w = {n: np.ascontiguousarray(weights[n], np.float32) for n in need}
        self.prefix = p
        own_embed = weights.get("embed_tokens.weight")
        self.embed = np.ascontiguousarray(own_embed, np.float32) if own_embed is not None else embed
        self.inv_freq = rope_inv_freq(spec)
        self.norm_before_residual = bool(params.get("norm_before_residual", False))
        self.vocab = embed.shape[0]
        if kind == "eagle":
            self.head = target_head  # (V, H): EAGLE-1 uses the target's LM head
            self.draft_ids = None
            self.target_taps: Tuple[str, ...] = ("final_norm",)
        else:
            self.head = self.w.get("lm_head.weight")  # (draft_vocab, H); None when the graph holds it
            d2t = weights.get("d2t")
            rows = weights["lm_head.weight"].shape[0]
            self.draft_ids = np.arange(rows) + np.asarray(d2t, np.int64) if d2t is not None else None
            if self.draft_ids is None and rows != self.vocab:
                raise BundleError(f"{source}: lm_head has {rows} rows but there is no d2t map to the target's "
                                  f"{self.vocab} ids; rebuild the bundle's eagle3 drafter")
            layers = params.get("tap_layers")
            if not isinstance(layers, list) or len(layers) != 3:
                raise BundleError(f"{source}: params.tap_layers {layers!r}: expected three target layer indices")
            self.target_taps = tuple(f"layer_in.{int(i)}" for i in layers)
        self.committed_rows = 0
        self.pending = None  # (n, H) features of committed positions not yet run (a property: see `pending`)
        # the step on its own cache: as an ONNX graph (runtime/backends/onnx_net.OnnxNet) when given, else numpy
        self.head_runner = HeadRunner(cache, net, inputs=("input_ids", "features", "position_ids", "attention_mask"),
                                      outputs=("logits", "hidden"))
        # the head's K-step chain graph (runtime/drafters/heads.HeadKStep: a whole chain in one run), or None
        self.kstep = kstep
        self._paths: Dict[str, int] = {KSTEP: 0, STEPWISE: 0}

    @property
    def net(self):
        return self.head_runner.net

    @property
    def draft_paths(self) -> Dict[str, int]:
        return dict(self._paths) if self.kstep is not None else {}

    @net.setter
    def net(self, net) -> None:
        self.head_runner.net = net

    @property
    def memory_bytes(self) -> int:
        own = sum(a.nbytes for a in self.w.values())
        if self.net is not None:  # the layer, head (and an own embedding) are the graph's
            return own + self.head_runner.weight_bytes
        return own + (self.embed.nbytes if "embed_tokens.weight" in self.w else 0)

    # -- the draft layer --------------------------------------------------------------------------

    @property
    def pending(self) -> Optional[np.ndarray]:
        """(n, H) features of the committed positions not yet run. The taps of cycles that drafted nothing wait
        raw, as the target returned them, and are fused and projected (EAGLE-3's fc) in one batched product when
        the head next runs, so that a plain step of an adaptive shape pays no head work, not even a concatenation."""
        if self._raw:
            new = self._project(self._fuse({t: np.concatenate([r[t] for r in self._raw]) for t in self.target_taps}))
            self._feats = new if self._feats is None else np.concatenate([self._feats, new])
            self._raw = []
        return self._feats

    @pending.setter
    def pending(self, features: Optional[np.ndarray]) -> None:
        self._feats, self._raw = features, []

    def _fuse(self, taps: Dict[str, np.ndarray]) -> np.ndarray:
        """Target taps at committed positions -> (n, H) (EAGLE-1's final norm) or (n, 3H) (EAGLE-3's three)."""
        if self.kind == "eagle":
            return np.asarray(taps["final_norm"], np.float32)
        return np.concatenate([np.asarray(taps[t], np.float32) for t in self.target_taps], axis=-1)

    def _project(self, fused: np.ndarray) -> np.ndarray:
        return fused if self.kind == "eagle" else fused @ self.w["fc.weight"].T  # (n, H)

    def _features(self, taps: Dict[str, np.ndarray]) -> np.ndarray:
        """Target taps at committed positions -> the draft layer's input features (n, H)."""
        return self._project(self._fuse(taps))

    def _run(self, features: np.ndarray, tokens: Sequence[int], positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Draft-layer rows for (features (T, H), tokens (T,)) at `positions`, appended to the cache, in numpy -> h' (T, H)."""
        return self.head_runner.run(len(tokens), lambda start: self._layer(features, tokens, positions, mask, start),
                                    None, None, use_graph=False)

    def _layer(self, features: np.ndarray, tokens: Sequence[int], positions: np.ndarray, mask: np.ndarray,
               start: int) -> np.ndarray:
        """The draft layer in numpy over rows written at cache rows start.. -> h' (T, H)."""
        w, p, spec = self.w, self.prefix, self.spec
        emb = self.embed[np.asarray(tokens, np.int64)]  # (T, H)
        if self.kind == "eagle":
            x = np.concatenate([emb, features], axis=-1) @ w["fc.weight"].T  # (T, H): embedding first
            if "fc.bias" in w:
                x = x + w["fc.bias"]
            attn_in = x  # layer 0 of EAGLE-1 has no input norm
        else:
            hn = rms_norm(features, w[p + "hidden_norm.weight"], spec.rms_norm_eps)
            attn_in = np.concatenate([rms_norm(emb, w[p + "input_layernorm.weight"], spec.rms_norm_eps), hn], axis=-1)
            x = hn if self.norm_before_residual else features
        cos, sin = rope_cos_sin(self.inv_freq, np.asarray(positions, np.int64))
        return decoder_layer(w, p, spec, x, cos, sin, self.cache.k[:, 0], self.cache.v[:, 0], start, mask,
                             attn_input=attn_in)

    def _draft_logits(self, hidden: np.ndarray) -> np.ndarray:
        """h' (T, H) -> (T, V') logits of the head (EAGLE-3: over its draft vocabulary)."""
        if self.kind == "eagle":
            return hidden @ self.head.T
        return rms_norm(hidden, self.w["norm.weight"], self.spec.rms_norm_eps) @ self.head.T  # (T, draft_vocab)

    def _to_target(self, draft: np.ndarray) -> np.ndarray:
        """(T, V') head logits -> (T, V) over the TARGET's vocabulary (EAGLE-3 places draft ids by d2t)."""
        if self.draft_ids is None:
            return draft
        out = np.full((draft.shape[0], self.vocab), UNMAPPED, np.float32)
        out[:, self.draft_ids] = draft
        return out

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """h' (T, H) -> (T, V) logits over the TARGET's vocabulary."""
        return self._to_target(self._draft_logits(hidden))

    def _step(self, features: np.ndarray, tokens: Sequence[int], positions: np.ndarray, mask: np.ndarray,
              last_only: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """One draft-layer call, rows appended to the cache -> (h' (T, H), target-vocabulary logits (T or 1, V)),
        on the ONNX graph when there is one, else in numpy (the oracle the export was checked against)."""
        def numpy_step(start: int) -> Tuple[np.ndarray, np.ndarray]:
            out = self._layer(features, tokens, positions, mask, start)
            return out, self._logits(out[-1:] if last_only else out)

        t = len(tokens)
        rows_input = self.net is not None and "logit_rows" in self.net.input_names  # not in an older export

        def feeds(start: int) -> Dict[str, np.ndarray]:
            f = {"input_ids": np.asarray(tokens, np.int64), "features": np.asarray(features, np.float32),
                 "position_ids": np.asarray(positions, np.int64),
                 "attention_mask": np.where(mask, np.float32(0.0), np.float32(-np.inf))}
            if rows_input:  # a catch-up's logits: its last row's alone
                f["logit_rows"] = np.arange(t - 1, t) if last_only else np.arange(t)
            return f

        def from_graph(got: Dict[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
            logits = got["logits"]
            return got["hidden"], self._to_target(logits[-1:] if last_only else logits)

        return self.head_runner.run(len(tokens), numpy_step, feeds, from_graph)

    # -- the drafter interface --------------------------------------------------------------------

    def reset(self) -> None:
        self.cache.reset()
        self.committed_rows = 0
        self.pending = None

    def begin(self, prompt: Sequence[int], taps: Dict[str, np.ndarray], start: int = 0) -> None:
        self.reset()  # (start is always 0: reusable_prefix keeps nothing)
        # fused and projected when the head first runs: a request an adaptive shape never drafts in does neither
        self._feats, self._raw = None, [taps]

    def accept(self, accepted_nodes, committed, taps) -> None:
        self.cache.keep(self.committed_rows, [])  # drop the drafted rows
        # Appended, not replaced: after a cycle that drafted nothing (an adaptive shape's plain step) the rows
        # of the cycle before are still waiting to be run.
        self._raw.append(taps)  # fused and projected when the head next runs (`pending`)

    def _catch_up(self, tokens: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        """Run the rows of newly committed positions: row t = (feature f_t, token x_{t+1}). Returns the last
        row's h' (1, H) and logits (V,), the drafter's prediction after the root tokens[-1]."""
        self.cache.keep(self.committed_rows, [])
        first, feats = self.committed_rows, self.pending
        n = feats.shape[0]
        if first + n != len(tokens) - 1:
            raise RuntimeError(f"EAGLE drafter out of step: {first} + {n} rows for a context of {len(tokens)} tokens")
        for s in range(0, max(n, 1), self.prefill_chunk):  # a new prompt in chunks, as the target prefilled it
            a, m = first + s, min(self.prefill_chunk, n - s)
            out, logits = self._step(feats[s:s + m], tokens[a + 1:a + 1 + m], np.arange(a, a + m), causal_mask(a, m),
                                     last_only=True)
        self.committed_rows += n
        self.pending = feats[:0]
        return out[-1:], logits[0]

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = list(ctx.tokens)
        if self.tree is None and self.kstep is not None:
            self.cache.keep(self.committed_rows, [])
            feats = self.pending
            room = self.cache.max_positions - self.cache.length - feats.shape[0]  # rows past the catch-up
            depth = min(self.k, ctx.max_nodes // self.branching, 1 + room // self.branching)
            if kstep_fits(ctx, self.kstep, self.branching, depth, feats.shape[0], room, self.prefill_chunk):
                return self._propose_kstep(ctx, tokens, feats, depth)
        self._paths[STEPWISE] += 1
        h_root, root_logits = self._catch_up(tokens)
        room = self.cache.max_positions - self.cache.length  # temporary rows left for drafting
        if self.tree is not None:
            return self._dynamic(ctx, tokens, h_root, root_logits, room)
        return self._chains(ctx, tokens, h_root, root_logits, room)

    def _propose_kstep(self, ctx: DraftContext, tokens: List[int], feats: np.ndarray, depth: int) -> DraftTree:
        """A chain from one run of the K-step graph: the catch-up rows and K drafted tokens (`shared.kstep_chain`
        cuts it as the step-wise chain would be cut). Its drafted rows are temporary, as the step-wise ones."""
        first, n = self.committed_rows, feats.shape[0]
        if first + n != len(tokens) - 1:
            raise RuntimeError(f"EAGLE drafter out of step: {first} + {n} rows for a context of {len(tokens)} tokens")
        self._paths[KSTEP] += 1
        got = self.kstep.run(self.cache, tokens[first + 1:], feats, np.arange(first, first + n), ctx.params, tokens,
                             kstep_uniforms(ctx, self.kstep.steps))
        self.committed_rows += n
        self.pending = feats[:0]
        return kstep_chain(ctx, got.tokens, got.q, got.confidence, depth)

    def _chains(self, ctx: DraftContext, tokens: List[int], h_root, root_logits, room: int) -> DraftTree:
        b = self.branching
        depth = min(self.k, ctx.max_nodes // b, 1 + room // b)
        if depth <= 0:
            return empty_tree()
        hidden = {-1: h_root[0]}  # node -> h' of the row that predicted its children
        rows: Dict[int, int] = {}  # node -> its temporary cache row
        root_pos = len(tokens) - 1

        def run(frontier: List[int], out_tokens: List[int], parents: List[int], d: int) -> np.ndarray:
            """The frontier (one node per chain, depth d) on its parents' h' in one step under the tree mask."""
            start = self.cache.length
            anc = [[rows[a] for a in path_to(parents, n)[:-1]] for n in frontier]
            feats = np.stack([hidden[parents[n]] for n in frontier])
            out, logits = self._step(feats, [out_tokens[n] for n in frontier], np.full(len(frontier), root_pos + d - 1),
                                     tree_mask(self.committed_rows, anc, start))
            for j, node in enumerate(frontier):
                rows[node] = start + j
                hidden[node] = out[j]
            return logits

        return grow_chains(ctx, tokens, root_logits, b, depth, self.sibling_rule, run)

    def _dynamic(self, ctx: DraftContext, tokens: List[int], h_root, root_logits, room: int) -> DraftTree:
        tree = replace(self.tree, depth=min(self.tree.depth, 1 + room // self.tree.top_k))
        # Rank by the drafter's processed distribution (greedy: at temperature 1); the picks are point masses.
        rank = ranking_params(ctx.params)
        hidden = {-1: h_root[0]}  # node -> h' of the row that predicted its children
        rows: Dict[int, int] = {}  # node -> its temporary cache row

        def log_q(logits: np.ndarray, path: List[int]) -> np.ndarray:
            with np.errstate(divide="ignore"):
                return np.log(process_logits(logits, rank, tokens + path, ctx.mask(path)))

        def expand(frontier: List[int], toks: List[int], pars: List[int]) -> List[np.ndarray]:
            start = self.cache.length
            paths = [path_to(pars, n) for n in frontier]
            out, logits = self._step(np.stack([hidden[pars[n]] for n in frontier]), [toks[n] for n in frontier],
                                     np.asarray([len(tokens) - 2 + len(path) for path in paths]),
                                     tree_mask(self.committed_rows, [[rows[a] for a in path[:-1]] for path in paths],
                                               start))
            res = []
            for j, (n, path) in enumerate(zip(frontier, paths)):
                rows[n] = start + j
                hidden[n] = out[j]
                res.append(log_q(logits[j], [toks[a] for a in path]))
            return res

        toks, pars, conf = dynamic_tree(expand, log_q(root_logits, []), tree, ctx.max_nodes, ctx.stop)
        if not toks:
            return empty_tree()
        return DraftTree(tokens=np.asarray(toks, np.int64), parents=np.asarray(pars, np.int64),
                         confidence=np.asarray(conf, np.float64) if ctx.wants_confidence else None)


# -- built from a bundle entry ------------------------------------------------------------------

@dataclass(frozen=True)
class EagleParams:
    """bundle.yaml drafters.<name>.params of an EAGLE head (kind eagle or eagle3). The head itself reads the
    rest (bias, tap_layers, norm_before_residual) from the same mapping."""
    tree: Optional[DynamicTree] = None  # set: the EAGLE-2 dynamic tree; None: chains of num_tokens x branching
    draft_vocab_size: Optional[int] = None  # EAGLE-3: rows of its own LM head
    kstep: str = "auto"  # a chain in one run of the head's K-step graph: auto (GPU providers) | on | off

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "EagleParams":
        tree = d.get("tree")
        if tree is not None and not isinstance(tree, dict):
            raise BundleError(f"{where}.tree: got {tree!r}, expected a mapping (total_tokens, depth, top_k)")
        vocab = d.get("draft_vocab_size")
        return EagleParams(DynamicTree.from_params(tree, where) if tree is not None else None,
                           None if vocab is None else int(vocab), kstep_mode(d, where))


def build(b: DrafterBuild, p: EagleParams) -> EagleDrafter:
    """An EAGLE-1/2 or EAGLE-3 head on the target's embedding (and, EAGLE-1, its LM head). Its step runs on the
    entry's ONNX graph when the backend is onnx and the entry has one, else in numpy."""
    bundle, entry, source = b.bundle, b.entry, b.source
    if entry.spec is None:
        raise BundleError(f"{source}: no spec (the draft layer's shape); rebuild it with export/drafters/eagle.py")
    embed, head = b.embed_and_head()
    cache = b.arena.allocate("draft", cache_shape(entry.spec), b.max_positions + memory_plan.DRAFT_SLACK)
    graphs = head_graphs(b, f"{entry.kind} head {b.name}")
    # one chain per K-step run: a tree or split chains (branching > 1) draft step-wise, so it is not opened
    kstep = (head_kstep(b, p.kstep, f"{entry.kind} K-step {b.name}") if graphs and p.tree is None and b.branching == 1
             else None)
    return EagleDrafter(entry.kind, entry.spec, load_weights(bundle, entry.files), embed, head, cache, entry.params,
                        num_tokens=b.num_tokens, branching=b.branching, tree=p.tree, source=source,
                        net=graphs[0] if graphs else None, kstep=kstep)


def eagle_dims(entry, p: EagleParams) -> memory_plan.ModelDims:
    """An EAGLE head's one layer: it reads the target's embedding; EAGLE-1 uses the target's LM head (fc 2H -> H),
    EAGLE-3 has its own over draft_vocab_size rows, attends over 2H and fuses three target hiddens (fc 3H -> H)."""
    d = replace(memory_plan.dims_from_spec(entry.spec), own_embedding=False)
    h = d.hidden
    if entry.kind == "eagle":
        return replace(d, head_rows=0, fusion_in=2 * h)
    return replace(d, head_rows=p.draft_vocab_size or d.vocab, attn_in=2 * h, fusion_in=3 * h)


def memory(bundle, entry, p: EagleParams, backend: str) -> memory_plan.DrafterMemory:
    """Its layer in float32 numpy; beside a graph target, its own float32 copy of the target's embedding (and head)."""
    if entry.spec is None:
        return memory_plan.NO_DRAFTER
    extra = target_embedding_copy_bytes(bundle.target.spec) if backend != "numpy_ref" else 0
    kstep = kstep_memory(bundle, entry, backend) if p.tree is None else 0  # a tree drafts step-wise
    return memory_plan.DrafterMemory(eagle_dims(entry, p), "fp32", extra, prefill_chunked=True, kstep_bytes=kstep,
                                     kstep_mode=p.kstep, kstep_chain_only=True)


SPEC = DrafterSpec(kinds=("eagle", "eagle3"), params=EagleParams.from_dict, build=build, memory=memory,
                   sources={"eagle": ("--eagle DIR", "a head from `edgespec train-drafter eagle1 --target DIR --out DIR`"),
                            "eagle3": ("--eagle3 DIR", "a head from `edgespec train-drafter eagle3 --target DIR --out DIR`")})
