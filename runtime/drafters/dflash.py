"""DFlash and DFlash-2 (z-lab layout): a whole block of draft tokens from ONE drafter forward.

    c_j   = hidden_norm(fc(concat[target layer_out.{i} for i in target_layer_ids]))   context rows (C, H)
    block = embed([last verified token, mask, ..., mask])                            (B, H), B = block_size
    every draft layer: queries over the block only; K/V over [context; block]; NO causal mask inside the
    block; K/V of a context row = k/v_proj(c_j) (k_norm, rope at the row's position), the same in every
    layer's cache; logits of draft slot t = target_lm_head(norm(x_{t})) for block rows 1..B-1.

Context K/V rows persist in the drafter's cache (one row per committed position); the block's rows are
temporary. DFlash-2 adds, per layer, a two-tap dynamic depthwise causal convolution ("local mixing",
zero across the block start) around attention and around the MLP, and a candidate selector that walks
the block slot by slot from the last verified token (`select_walk`).

Exactness: every draft token is drawn from the q handed to the verifier. DFlash draws slot t from its own
processed distribution (the slots are independent given the context). DFlash-2 walks greedily (the official
select) and, sampled, draws slot t from its marginal as DFlash does, unless the bundle's params set
`sampled_walk: true`: then from the walk's conditional q_t(. | previous drafted token) (zero outside the slot's
candidates), never its marginal. The sampled walk is off by default because it was measured to lose: on the zoo
(trained DFlash-2, 16-slot block, T = 1, bench prompts) tau 3.65 with the walk against 5.03 with the marginals,
slot-1 acceptance sum(min(p, q)) 0.68 / 0.58 (action / text) against 0.84 / 0.70; greedy, the walk wins (tau
4.33 against 3.68)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.factory import load_weights
from runtime.backends.numpy_ref import cache_shape
from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec
from runtime.drafters.heads import HeadRunner, head_graphs
from runtime.drafters.shared import node_confidence, pick, ranking_params
from runtime.errors import BundleError
from runtime.memory import plan as memory_plan
from runtime.memory.bundle_sizes import entry_numel, target_embedding_copy_bytes
from runtime.memory.kv import KVCache
from runtime.model.layers import apply_rope, attention, rms_norm, rope_cos_sin, rope_inv_freq, silu
from runtime.model.spec import ModelSpec
from runtime.sampling import process_logits
from runtime.tree import DraftTree, empty_tree

LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight")
CONV_KEYS = tuple(f"{m}.{k}" for m in ("attention_conv", "mlp_conv") for k in ("base_kernel", "kernel_projection.weight"))
# The selector's codebooks are stored WITHOUT `.weight` (nn.Parameter in the official module).
SELECTOR_KEYS = ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                 "candidate_selector.successor_codebook")


@dataclass(frozen=True)
class DFlashParams:
    """What the bundle records about a DFlash drafter (bundle.yaml drafters.<name>.params)."""
    block_size: int
    mask_token_id: int
    target_layer_ids: Tuple[int, ...]
    conv_group_size: int = 0  # DFlash-2 only (0 = DFlash)
    conv_kernel_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    sampled_walk: bool = False  # DFlash-2, T > 0: draw from the walk's conditional (else the slot marginals)

    @property
    def v2(self) -> bool:
        return self.selector_top_k > 0

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "DFlashParams":
        def num(key, default=None):
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BundleError(f"{where}.{key}: got {v!r}, expected an integer >= 0")
            return v
        ids = d.get("target_layer_ids")
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise BundleError(f"{where}.target_layer_ids: got {ids!r}, expected a list of target layer indices")
        p = DFlashParams(num("block_size"), num("mask_token_id"), tuple(ids), num("conv_group_size", 0),
                         num("conv_kernel_size", 0), num("selector_rank", 0), num("selector_top_k", 0),
                         d.get("sampled_walk", False))
        if not isinstance(p.sampled_walk, bool):
            raise BundleError(f"{where}.sampled_walk: got {p.sampled_walk!r}, expected true or false")
        if p.block_size < 2:
            raise BundleError(f"{where}.block_size: got {p.block_size}, expected >= 2 (the anchor + drafts)")
        return p


def dflash_weight_names(spec: ModelSpec, p: DFlashParams) -> List[str]:
    """Every tensor the runtime reads, in the official key layout (no embedding, no lm_head)."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(spec.num_layers):
        names += [f"layers.{i}.{k}" for k in LAYER_KEYS + (CONV_KEYS if p.v2 else ())]
        if spec.qkv_bias:
            names += [f"layers.{i}.self_attn.{x}_proj.bias" for x in "qkv"]
    return names + (list(SELECTOR_KEYS) if p.v2 else [])


def dflash_weight_shapes(spec: ModelSpec, p: DFlashParams, target_hidden: int) -> Dict[str, Tuple[int, ...]]:
    """name -> expected shape (checked by the exporter and by the runtime)."""
    h, nh, nkv, d, ff, v = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                            spec.intermediate_size, spec.vocab_size)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (nh * d, h), "self_attn.k_proj.weight": (nkv * d, h),
             "self_attn.v_proj.weight": (nkv * d, h), "self_attn.o_proj.weight": (h, nh * d),
             "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,), "mlp.gate_proj.weight": (ff, h),
             "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff),
             "self_attn.q_proj.bias": (nh * d,), "self_attn.k_proj.bias": (nkv * d,), "self_attn.v_proj.bias": (nkv * d,)}
    if p.v2:
        groups = h // p.conv_group_size if p.conv_group_size else 0
        for m in ("attention_conv", "mlp_conv"):
            layer[f"{m}.base_kernel"] = (2, p.conv_kernel_size, h)
            layer[f"{m}.kernel_projection.weight"] = (2 * p.conv_kernel_size * groups, h)
    shapes = {"fc.weight": (h, len(p.target_layer_ids) * target_hidden), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "candidate_selector.hidden_projection.weight": (p.selector_rank, h),
              "candidate_selector.predecessor_codebook": (v, p.selector_rank),
              "candidate_selector.successor_codebook": (v, p.selector_rank)}
    for i in range(spec.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    return shapes


def check_dflash_weights(weights: Mapping[str, np.ndarray], spec: ModelSpec, p: DFlashParams, target_hidden: int,
                         source: str) -> None:
    """Refuse a checkpoint that is not the official layout, naming the first bad key."""
    kind = "DFlash-2" if p.v2 else "DFlash"
    if p.v2:
        if p.conv_kernel_size != 2:
            raise BundleError(f"{source}: conv_kernel_size {p.conv_kernel_size}: this runtime runs the two-tap "
                              "local mixing of DFlash-2 (conv_kernel_size 2)")
        if p.conv_group_size <= 0 or spec.hidden_size % p.conv_group_size:
            raise BundleError(f"{source}: conv_group_size {p.conv_group_size} does not divide hidden_size "
                              f"{spec.hidden_size}")
        if p.selector_rank <= 0:
            raise BundleError(f"{source}: selector_rank {p.selector_rank}: expected >= 1")
    names = dflash_weight_names(spec, p)
    shapes = dflash_weight_shapes(spec, p, target_hidden)
    for n in names:
        if n not in weights:
            quirk = ""
            if n.endswith("_codebook") and n + ".weight" in weights:
                quirk = f" (found {n}.weight: the official layout stores the codebooks without `.weight`)"
            raise BundleError(f"{source}: missing tensor {n!r} of the {kind} layout{quirk}")
        if tuple(weights[n].shape) != shapes[n]:
            raise BundleError(f"{source}: tensor {n!r} has shape {tuple(weights[n].shape)}, expected {shapes[n]} "
                              f"for this config")
    extra = sorted(set(weights) - set(names))
    if extra:
        hint = " (a DFlash-2 checkpoint? its config needs selector_top_k)" if any(
            "candidate_selector" in e or "_conv." in e for e in extra) else ""
        raise BundleError(f"{source}: unexpected tensor {extra[0]!r} for the {kind} layout{hint}")


def _shift(x: np.ndarray) -> np.ndarray:
    """x_{t-1} along the block, zero at the block start (the convolution never looks across it)."""
    out = np.zeros_like(x)
    out[1:] = x[:-1]
    return out


def local_mix(x: np.ndarray, base: np.ndarray, dyn: np.ndarray, group: int) -> np.ndarray:
    """DFlash-2's two-tap dynamic depthwise causal convolution over one block.

        out_t = (base[0] + dyn[t, 0, g]) * x_t + (base[1] + dyn[t, 1, g]) * x_{t-1},   x_{-1} = 0
    x (B, H); base (2, H) per channel; dyn (B, 2, G) per channel group of `group` channels.
    Example: H = 2, one group, base = ((1, 1), (0, 0)), dyn = 0 -> out = x."""
    b, h = x.shape
    w = base[None] + np.repeat(dyn, group, axis=-1)  # (B, 2, H)
    return w[:, 0] * x + w[:, 1] * _shift(x)


def pair_scores(hidden_proj: np.ndarray, pred_codes: np.ndarray, succ_codes: np.ndarray) -> np.ndarray:
    """<A(a) * H(h_t), B(b)> for every predecessor a (rows) and successor b (columns): (Ka, Kb)."""
    return (pred_codes * hidden_proj[None, :]) @ succ_codes.T


class DFlashDrafter(Drafter):
    """One forward per cycle; a chain of block_size - 1 drafts (fewer near the budget's end)."""
    kind = "dflash"

    def __init__(self, spec: ModelSpec, params: DFlashParams, weights: Mapping[str, np.ndarray], embed: np.ndarray,
                 head: np.ndarray, cache: KVCache, source: str = "dflash drafter", net=None):
        """`net`: the block forward as an ONNX graph (runtime/backends/onnx_net.py OnnxNet, contract in
        export/drafters/dflash_onnx.py); None runs it in numpy (the oracle the graph was checked against)."""
        check_dflash_weights(weights, spec, params, embed.shape[1], source)
        if embed.shape[1] != spec.hidden_size:
            raise BundleError(f"{source}: hidden_size {spec.hidden_size} differs from the target's {embed.shape[1]}; "
                              "a DFlash drafter runs on the target's embedding and LM head")
        self.kind = "dflash2" if params.v2 else "dflash"
        self.spec, self.p = spec, params
        self.w = {n: np.ascontiguousarray(weights[n], np.float32) for n in dflash_weight_names(spec, params)}
        self.embed, self.head = embed, head
        self.cache = cache
        self.inv_freq = rope_inv_freq(spec)
        self.target_taps = tuple(f"layer_out.{i}" for i in params.target_layer_ids)
        self.pending: List[Dict[str, np.ndarray]] = []  # target taps of committed positions not yet in the cache
        self.last_walk: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None  # DFlash-2: (candidates, q matrix)/slot
        self.head_runner = HeadRunner(cache, net, layers=spec.num_layers, outputs=("hidden",),
                                      inputs=("context", "block", "context_cos", "context_sin", "block_cos", "block_sin"))

    @property
    def net(self):
        return self.head_runner.net

    @net.setter
    def net(self, net) -> None:
        self.head_runner.net = net

    @property
    def memory_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

    def reset(self) -> None:
        self.cache.reset()
        self.pending = []

    def begin(self, prompt: Sequence[int], taps: Dict[str, np.ndarray], start: int = 0) -> None:
        self.reset()  # (start is always 0: reusable_prefix keeps nothing)
        self._take(taps)

    def accept(self, accepted_nodes, committed, taps) -> None:
        self._take(taps)

    def _take(self, taps: Dict[str, np.ndarray]) -> None:
        """Keep the taps of newly committed positions as the target returned them: they are fused (concatenated
        per row) only when the next block runs, so a cycle that drafts nothing does no work on them."""
        missing = [t for t in self.target_taps if t not in taps]
        if missing:
            raise BundleError(f"{self.kind} drafter: the target returned no hidden tap {missing[0]!r}")
        self.pending.append(taps)

    def _fused_pending(self) -> np.ndarray:
        """(C, n*H): the fused taps of the pending context rows, in order."""
        if not self.pending:
            return np.zeros((0, self.w["fc.weight"].shape[1]), np.float32)
        return np.concatenate([np.concatenate([r[t] for r in self.pending]) for t in self.target_taps], axis=-1)

    # -- the forward -----------------------------------------------------------------------------

    def _layer(self, i: int, x: np.ndarray, ctx: np.ndarray, cos_c, sin_c, cos_b, sin_b) -> np.ndarray:
        """One draft layer over the block x (B, H); ctx (C, H) are the new context rows (written to the cache)."""
        w, spec, p = self.w, self.spec, self.p
        pre = f"layers.{i}."
        nh, nkv, d, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
        cache_k, cache_v = self.cache.k[:, i], self.cache.v[:, i]
        start, c, b = self.cache.length, ctx.shape[0], x.shape[0]

        def kv(h, cos, sin):
            k = h @ w[pre + "self_attn.k_proj.weight"].T
            v = h @ w[pre + "self_attn.v_proj.weight"].T
            if spec.qkv_bias:
                k, v = k + w[pre + "self_attn.k_proj.bias"], v + w[pre + "self_attn.v_proj.bias"]
            k = rms_norm(k.reshape(len(h), nkv, d), w[pre + "self_attn.k_norm.weight"], eps)
            return apply_rope(k, cos, sin), v.reshape(len(h), nkv, d)

        def mixed(name, h):
            """(conv_in(h), the output kernel) for DFlash-2; (h, None) for DFlash."""
            if not p.v2:
                return h, None
            base = w[f"{pre}{name}.base_kernel"]  # (2 in/out, 2 taps, H)
            dyn = (h @ w[f"{pre}{name}.kernel_projection.weight"].T).reshape(b, 2, 2, -1)  # (B, in/out, tap, G)
            return local_mix(h, base[0], dyn[:, 0], p.conv_group_size), (base[1], dyn[:, 1])

        def unmix(h, kernel):
            return h if kernel is None else local_mix(h, kernel[0], kernel[1], p.conv_group_size)

        h, kernel = mixed("attention_conv", rms_norm(x, w[pre + "input_layernorm.weight"], eps))
        q = h @ w[pre + "self_attn.q_proj.weight"].T
        if spec.qkv_bias:
            q = q + w[pre + "self_attn.q_proj.bias"]
        q = apply_rope(rms_norm(q.reshape(b, nh, d), w[pre + "self_attn.q_norm.weight"], eps), cos_b, sin_b)
        if c:
            cache_k[start:start + c], cache_v[start:start + c] = kv(ctx, cos_c, sin_c)
        cache_k[start + c:start + c + b], cache_v[start + c:start + c + b] = kv(h, cos_b, sin_b)
        mask = np.ones((b, start + c + b), bool)  # the whole context and the whole block: no causal mask
        attn = attention(q, cache_k[:start + c + b], cache_v[:start + c + b], mask)
        x = x + unmix(attn @ w[pre + "self_attn.o_proj.weight"].T, kernel)
        h, kernel = mixed("mlp_conv", rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps))
        mlp = (silu(h @ w[pre + "mlp.gate_proj.weight"].T) * (h @ w[pre + "mlp.up_proj.weight"].T)) @ w[pre + "mlp.down_proj.weight"].T
        return x + unmix(mlp, kernel)

    def forward(self, anchor: int, anchor_pos: int, block_size: int) -> Tuple[np.ndarray, np.ndarray]:
        """Run the pending context rows and the block [anchor, mask...] at anchor_pos..; the context rows stay
        in the cache. Returns (final-normed hidden (B-1, H), logits (B-1, V)) of the draft slots."""
        spec, eps = self.spec, self.spec.rms_norm_eps
        fused = self._fused_pending()
        c = fused.shape[0]
        start = self.cache.length
        if start + c != anchor_pos:
            raise RuntimeError(f"{self.kind} drafter: {start} cached + {c} pending context rows, but the anchor is at "
                               f"position {anchor_pos}; accept()/begin() were not called for every cycle")
        x = self.embed[np.asarray([anchor] + [self.p.mask_token_id] * (block_size - 1))].astype(np.float32)
        cos_c, sin_c = rope_cos_sin(self.inv_freq, np.arange(start, start + c))
        cos_b, sin_b = rope_cos_sin(self.inv_freq, np.arange(anchor_pos, anchor_pos + block_size))

        def numpy_step(_start: int) -> np.ndarray:  # (_layer writes its rows from the cache's length on)
            h, ctx = x, rms_norm(fused.astype(np.float32) @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], eps)
            for i in range(spec.num_layers):
                h = self._layer(i, h, ctx, cos_c, sin_c, cos_b, sin_b)
            return rms_norm(h[1:], self.w["norm.weight"], eps)

        def feeds(_start: int) -> Dict[str, np.ndarray]:
            return {"context": fused.astype(np.float32), "block": x, "context_cos": cos_c, "context_sin": sin_c,
                    "block_cos": cos_b, "block_sin": sin_b}

        # context rows persist, the block's are dropped (the graph returns the context rows' K/V only);
        # ORT refuses zero-row inputs: numpy takes those calls
        out = self.head_runner.run(c + block_size, numpy_step, feeds, lambda got: got["hidden"], keep=c,
                                   use_graph=c > 0 and block_size > 1)
        self.pending = []
        return out, out @ self.head.T

    # -- drafting --------------------------------------------------------------------------------

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        n = min(self.p.block_size - 1, ctx.max_nodes)
        self.last_walk = None
        if n <= 0:
            self._flush_context(int(tokens[-1]), len(tokens) - 1)
            return empty_tree()
        hidden, logits = self.forward(int(tokens[-1]), len(tokens) - 1, n + 1)
        if self.p.v2 and (ctx.params.greedy or self.p.sampled_walk):
            drafted, qs = self.select_walk(ctx, hidden, logits)
        else:
            drafted, qs = [], []
            for t in range(n):
                q = process_logits(logits[t], ctx.params, list(tokens) + drafted, ctx.mask(drafted))
                drafted.append(pick(q, ctx.params, ctx.rng))
                qs.append(q)
        greedy = ctx.params.greedy
        conf = None
        if ctx.wants_confidence:
            own = [float(q[t]) if self.p.v2 or not greedy else
                   node_confidence(logits[i], q, t, ctx.params, list(tokens) + drafted[:i], ctx.mask(drafted[:i]))
                   for i, (q, t) in enumerate(zip(qs, drafted))]
            if ctx.stop is not None:  # the block is cut where its slots stop paying
                cut = ctx.stop.keep_chain(qs, own, greedy)
                drafted, qs, own = drafted[:cut], qs[:cut], own[:cut]
            conf = np.cumprod(np.asarray(own, np.float64))
        return DraftTree(tokens=np.asarray(drafted, np.int64), parents=np.arange(-1, len(drafted) - 1, dtype=np.int64),
                         q=None if greedy or not qs else np.stack(qs), deterministic=np.full(len(drafted), greedy),
                         confidence=conf)

    def _flush_context(self, anchor: int, anchor_pos: int) -> None:
        """No room to draft: still move the pending context into the cache (a block of the anchor alone)."""
        if self.pending:
            self.forward(anchor, anchor_pos, 1)

    def select_walk(self, ctx: DraftContext, hidden: np.ndarray, logits: np.ndarray):
        """DFlash-2's path selector: per slot t keep the top-K candidates C_t, score adjacent pairs

            S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)>,   a in C_{t-1} (C_0 = {last verified token}), b in C_t

        and walk from the last verified token. Greedy: at each slot the best b after the walk's a (the
        official select). Sampled: b ~ q_t(b | a) = softmax_b(S_t(a, b)) with U_t = log p_t (the processed
        draft distribution, so the temperature scales the pair term too), and q_t(. | a) over the full
        vocabulary, zero outside C_t, is what the verifier gets: the distribution the walk sampled from.

        Example (K = 2, greedy): U_1 = (a: 1.0, b: 0.9), pair(anchor, .) = (0, 0.5) -> slot 1 takes b even
        though a is the slot's argmax. Records self.last_walk = [(C_t, Q_t (|C_{t-1}|, |C_t|))] per slot."""
        tokens, params = list(ctx.tokens), ctx.params
        w = self.w
        proj = hidden @ w["candidate_selector.hidden_projection.weight"].T  # (n, rank)
        pred_cb = w["candidate_selector.predecessor_codebook"]
        succ_cb = w["candidate_selector.successor_codebook"]
        k = self.p.selector_top_k
        prev_cands = np.asarray([tokens[-1]], np.int64)
        a_index = 0
        drafted: List[int] = []
        qs: List[np.ndarray] = []
        walk = []
        soft_params = ranking_params(params)
        for t in range(logits.shape[0]):
            p_t = process_logits(logits[t], soft_params, tokens + drafted, ctx.mask(drafted))
            live = np.flatnonzero(p_t > 0)
            if len(live) > k:  # the top K in O(V), then only those sorted
                live = live[np.argpartition(-p_t[live], k - 1)[:k]]
            cands = live[np.argsort(-p_t[live], kind="stable")]
            pair = pair_scores(proj[t], pred_cb[prev_cands], succ_cb[cands])  # (|C_{t-1}|, |C_t|)
            temp = 1.0 if params.greedy else params.temperature
            scores = np.log(p_t[cands])[None, :] + pair.astype(np.float64) / temp
            scores -= scores.max(axis=1, keepdims=True)
            cond = np.exp(scores)
            cond /= cond.sum(axis=1, keepdims=True)  # row a: q_t(. | a) over C_t
            row = cond[a_index]
            j = pick(row, params, ctx.rng)
            q = np.zeros(logits.shape[1])
            q[cands] = row
            qs.append(q)
            drafted.append(int(cands[j]))
            walk.append((cands, cond))
            prev_cands, a_index = cands, j
        self.last_walk = walk
        return drafted, qs


# -- built from a bundle entry ------------------------------------------------------------------

def build(b: DrafterBuild, params: DFlashParams) -> DFlashDrafter:
    bundle, entry = b.bundle, b.entry
    where = f"{bundle.path('bundle.yaml')}: drafters.{b.name}"
    if entry.spec is None:
        raise BundleError(f"{where}.spec: missing (the draft layers' shape); rebuild with `edgespec bundle --target DIR --dflash DIR --out DIR`")
    weights = load_weights(bundle, entry.files)
    embed, head = b.embed_and_head()
    # the context rows plus one block of temporary rows
    cache = b.arena.allocate("draft", cache_shape(entry.spec), b.max_positions + params.block_size)
    graphs = head_graphs(b, f"drafter {b.name}")  # the block forward as a graph, else numpy
    return DFlashDrafter(entry.spec, params, weights, embed, head, cache, source=where,
                         net=graphs[0] if graphs else None)


def memory(bundle, entry, p: DFlashParams, backend: str) -> memory_plan.DrafterMemory:
    """float32 numpy layers on the target's embedding and head (own copies beside an ONNX target); fc reads the
    fused target taps; DFlash-2's selector codebooks and local-mixing kernels come on top."""
    if entry.spec is None:
        return memory_plan.NO_DRAFTER
    spec = bundle.target.spec
    taps = len(p.target_layer_ids) or 1
    draft = replace(memory_plan.dims_from_spec(entry.spec), own_embedding=False, head_rows=0,
                    fusion_in=taps * spec.hidden_size)
    extra = 4 * max(0, entry_numel(bundle, entry) - draft.body_params())
    if backend != "numpy_ref":
        extra += target_embedding_copy_bytes(spec)
    return memory_plan.DrafterMemory(draft, "fp32", extra)


SPEC = DrafterSpec(kinds=("dflash", "dflash2"), params=DFlashParams.from_dict,
                   build=build, memory=memory,
                   sources={kind: ("--dflash DIR", f"a drafter from `edgespec train-drafter {kind} --target DIR --out DIR`")
                            for kind in ("dflash", "dflash2")})
