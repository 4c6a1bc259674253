"""The target's own MTP module (DeepSeek-V3 layout) as a drafter.

    h'_t  = eh_proj(concat[enorm(emb(x_{t+1})), hnorm(h_t)])    embedding first; h_t = target's last layer
    h''_t = decoder_layer(h'_t) at rotary position t             output BEFORE the final norm
    q(x_{t+2}) = head(shared_head.norm(h''_t))                    head and embedding are the target's

The module has its own one-layer KV cache (in the shared arena): row t holds (h_t, x_{t+1}). For a
chain deeper than one token the module is reused autoregressively on its own output h''_t, as MTP
runtimes do when asked for more draft tokens than the model has modules; those rows are temporary.

Three checkpoint layouts name the same module (`MTP_LAYOUTS`; the decoder layer keys follow the target family):
  deepseek_v3  model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm, [shared_head.head]}  concat [emb, hidden]
  qwen3_next   mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}, layer at mtp.layers.0   concat [emb, hidden]
  mimo         model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm} concat [hidden, emb]
(only module 0 of a checkpoint with several is used, reused autoregressively for deeper drafts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from runtime.drafters.base import DraftContext, Drafter
from runtime.errors import BundleError
from runtime.kv import CacheShape, KVCache
from runtime.layers import (causal_mask, decoder_layer, decoder_layer_weight_names, rms_norm, rope_cos_sin,
                            rope_inv_freq)
from runtime.model_spec import ModelSpec
from runtime.sampling import process_logits, sample
from runtime.tree import DraftTree, empty_tree


def mtp_cache_shape(spec: ModelSpec) -> CacheShape:
    return CacheShape(1, spec.num_kv_heads, spec.head_dim)


@dataclass(frozen=True)
class MTPLayout:
    """Where one MTP module's tensors live in a checkpoint ({n}: the module's layer index, DeepSeek-V3 only)."""
    prefix: str  # of the module's own tensors
    layer: str  # of its decoder layer
    emb_norm: str
    hidden_norm: str
    proj: str  # (H, 2H): the fused input's projection
    out_norm: str  # before the (shared) head
    head: Optional[str]  # the module's own head, if the layout may carry one
    hidden_first: bool  # concat order: [hidden, emb] (MiMo) instead of [emb, hidden]

    def names(self, n: int) -> Dict[str, str]:
        p, lp = self.prefix.format(n=n), self.layer.format(n=n)
        out = {"emb_norm": p + self.emb_norm, "hidden_norm": p + self.hidden_norm, "proj": p + self.proj,
               "out_norm": p + self.out_norm, "layer": lp}
        if self.head:
            out["head"] = p + self.head
        return out


MTP_LAYOUTS = {
    "deepseek_v3": MTPLayout("model.layers.{n}.", "model.layers.{n}.", "enorm.weight", "hnorm.weight",
                             "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight", False),
    "qwen3_next": MTPLayout("mtp.", "mtp.layers.0.", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                            "fc.weight", "norm.weight", None, False),
    "mimo": MTPLayout("model.mtp_layers.0.", "model.mtp_layers.0.", "token_layernorm.weight", "hidden_layernorm.weight",
                      "input_proj.weight", "final_layernorm.weight", None, True),
}


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], embed: np.ndarray, head: np.ndarray,
                 cache: KVCache, num_tokens: int = 2, layer_index: Optional[int] = None, layout: str = "deepseek_v3"):
        if layout not in MTP_LAYOUTS:
            raise BundleError(f"MTP module: layout {layout!r} unknown; expected one of {sorted(MTP_LAYOUTS)}")
        n = spec.num_layers if layer_index is None else layer_index
        keys = MTP_LAYOUTS[layout].names(n)
        p = keys["layer"]
        own = [keys[k] for k in ("emb_norm", "hidden_norm", "proj", "out_norm")]
        names = own + decoder_layer_weight_names(p, spec)
        missing = [k for k in names if k not in weights]
        if missing:
            raise BundleError(f"MTP module: missing weights {missing[:3]}; expected {layout} keys ({own[0]}, ...)")
        proj = np.asarray(weights[keys["proj"]])
        if proj.shape != (spec.hidden_size, 2 * spec.hidden_size):
            raise BundleError(f"MTP module: {keys['proj']} has shape {proj.shape}, expected "
                              f"({spec.hidden_size}, {2 * spec.hidden_size})")
        if MTP_LAYOUTS[layout].hidden_first:  # store [emb, hidden] columns: one concat order below
            proj = np.concatenate([proj[:, spec.hidden_size:], proj[:, :spec.hidden_size]], axis=1)
        self.w = {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in decoder_layer_weight_names(p, spec)}
        self.norms = {k: np.ascontiguousarray(weights[keys[k]], np.float32) for k in ("emb_norm", "hidden_norm", "out_norm")}
        self.proj = np.ascontiguousarray(proj, np.float32)  # (H, 2H), columns [emb, hidden]
        self.prefix = p
        self.layout = layout
        self.spec = spec
        self.embed = embed
        own_head = weights.get(keys.get("head", ""))
        self.head = np.ascontiguousarray(own_head, np.float32) if own_head is not None else head
        self.inv_freq = rope_inv_freq(spec)
        self.cache = cache
        self.k = num_tokens
        self.target_taps = (f"layer_out.{spec.num_layers - 1}",)
        self.committed_rows = 0  # MTP cache rows that belong to committed tokens
        self.pending: List[np.ndarray] = []  # target hidden states h_t not yet run through the module

    @property
    def memory_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values()) + self.proj.nbytes + sum(a.nbytes for a in self.norms.values())

    def reset(self) -> None:
        self.cache.reset()
        self.committed_rows = 0
        self.pending = []

    def begin(self, prompt: Sequence[int], taps: Dict[str, np.ndarray], start: int = 0) -> None:
        new = list(taps[self.target_taps[0]])  # h_t for t = start .. len(prompt) - 1
        if not start:
            self.reset()
            self.pending = new
            return
        # The target kept rows [0, start) (see reusable_prefix): keep module rows t < m (row t holds x_{t+1},
        # which is a kept token for t < start) and take h_t for t in [m, start) from what was pending.
        m = min(self.committed_rows, start)
        self.cache.keep(m, [])
        self.pending = self.pending[:start - m] + new
        self.committed_rows = m

    def reusable_prefix(self, n: int) -> int:
        """Module row t holds (h_t, x_{t+1}): with n target rows kept, rows t <= n - 2 stay valid. The module
        then needs h_t from its first row on: when its committed rows end before n - 1, the h_t still pending
        from the last request (target rows it has not run yet, all in the kept prefix) carry it as far as
        they go; otherwise it keeps n - 1 rows and the target reruns position n - 1 for its h."""
        if self.committed_rows <= n - 1:
            return min(n, self.committed_rows + len(self.pending))
        return max(0, n - 1)

    def _run(self, hidden: np.ndarray, next_tokens: Sequence[int], start_pos: int):
        """Module rows at positions start_pos.. -> (output hidden h'' (T, H), logits of the last row)."""
        w, p, spec, norms = self.w, self.prefix, self.spec, self.norms
        e = rms_norm(self.embed[np.asarray(next_tokens)], norms["emb_norm"], spec.rms_norm_eps)
        h = rms_norm(hidden, norms["hidden_norm"], spec.rms_norm_eps)
        x = np.concatenate([e, h], axis=-1) @ self.proj.T  # (T, H)
        t = x.shape[0]
        start = self.cache.length
        self.cache.check_room(t)
        cos, sin = rope_cos_sin(self.inv_freq, np.arange(start_pos, start_pos + t))
        out = decoder_layer(w, p, spec, x, cos, sin, self.cache.k[:, 0], self.cache.v[:, 0], start,
                            causal_mask(start, t))
        self.cache.length = start + t
        logits = rms_norm(out[-1], norms["out_norm"], spec.rms_norm_eps) @ self.head.T
        return out, logits

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = ctx.tokens
        self.cache.keep(self.committed_rows, [])
        first = self.committed_rows
        hidden = np.stack(self.pending)  # rows first .. len(tokens)-2: (h_t, x_{t+1})
        out, logits = self._run(hidden, tokens[first + 1:first + 1 + len(hidden)], first)
        self.committed_rows += len(hidden)
        self.pending = []
        depth = min(self.k, ctx.max_nodes, self.cache.max_positions - self.cache.length + 1)
        drafted: List[int] = []
        qs = []
        h_last = out[-1:]
        for d in range(depth):
            q = process_logits(logits, ctx.params, list(tokens) + drafted, ctx.mask(drafted))
            x = int(np.argmax(q)) if ctx.params.greedy else sample(q, ctx.rng)
            drafted.append(x)
            qs.append(q)
            if d + 1 < depth:  # feed the module its own output for the next position (temporary rows)
                h_last, logits = self._run(h_last, [x], len(tokens) - 1 + d + 1)
                h_last = h_last[-1:]
        if not drafted:
            return empty_tree()
        greedy = ctx.params.greedy
        return DraftTree(tokens=np.asarray(drafted, np.int64), parents=np.arange(-1, len(drafted) - 1, dtype=np.int64),
                         q=None if greedy else np.stack(qs), deterministic=np.full(len(drafted), greedy))

    def accept(self, accepted_nodes, committed, taps) -> None:
        self.cache.keep(self.committed_rows, [])  # drop the temporary rows of the chain
        # append: `propose` empties pending, but a cycle that verified no tree (one token left) did not run
        # the module over the previous cycle's rows, and those must not be lost
        self.pending = self.pending + list(taps[self.target_taps[0]])
