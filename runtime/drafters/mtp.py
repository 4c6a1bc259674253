"""The target's own MTP module (DeepSeek-V3 layout) as a drafter.

    h'_t  = eh_proj(concat[enorm(emb(x_{t+1})), hnorm(h_t)])    embedding first; h_t = target's last layer
    h''_t = decoder_layer(h'_t) at rotary position t             output BEFORE the final norm
    q(x_{t+2}) = head(shared_head.norm(h''_t))                    head and embedding are the target's

The module has its own one-layer KV cache (in the shared arena): row t holds (h_t, x_{t+1}). For a
chain deeper than one token the module is reused autoregressively on its own output h''_t, as MTP
runtimes do when asked for more draft tokens than the model has modules; those rows are temporary."""
from __future__ import annotations

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


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], embed: np.ndarray, head: np.ndarray,
                 cache: KVCache, num_tokens: int = 2, layer_index: Optional[int] = None):
        n = spec.num_layers if layer_index is None else layer_index
        p = f"model.layers.{n}."
        names = [p + s for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
        names += decoder_layer_weight_names(p, spec)
        missing = [k for k in names if k not in weights]
        if missing:
            raise BundleError(f"MTP module: missing weights {missing[:3]}; expected DeepSeek-V3 keys at {p}*")
        self.w = {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in names}
        self.prefix = p
        self.spec = spec
        self.embed = embed
        own_head = weights.get(p + "shared_head.head.weight")
        self.head = np.ascontiguousarray(own_head, np.float32) if own_head is not None else head
        self.inv_freq = rope_inv_freq(spec)
        self.cache = cache
        self.k = num_tokens
        self.target_taps = (f"layer_out.{spec.num_layers - 1}",)
        self.committed_rows = 0  # MTP cache rows that belong to committed tokens
        self.pending: List[np.ndarray] = []  # target hidden states h_t not yet run through the module

    @property
    def memory_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

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
        w, p, spec = self.w, self.prefix, self.spec
        e = rms_norm(self.embed[np.asarray(next_tokens)], w[p + "enorm.weight"], spec.rms_norm_eps)
        h = rms_norm(hidden, w[p + "hnorm.weight"], spec.rms_norm_eps)
        x = np.concatenate([e, h], axis=-1) @ w[p + "eh_proj.weight"].T  # (T, H)
        t = x.shape[0]
        start = self.cache.length
        self.cache.check_room(t)
        cos, sin = rope_cos_sin(self.inv_freq, np.arange(start_pos, start_pos + t))
        out = decoder_layer(w, p, spec, x, cos, sin, self.cache.k[:, 0], self.cache.v[:, 0], start,
                            causal_mask(start, t))
        self.cache.length = start + t
        logits = rms_norm(out[-1], w[p + "shared_head.norm.weight"], spec.rms_norm_eps) @ self.head.T
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
        self.pending = list(taps[self.target_taps[0]])
