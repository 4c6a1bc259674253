"""Training DFlash and DFlash-2 block drafters with the shared trainer (export/drafters/trainer.py).

One packed row of T tokens trains `anchors` blocks at once. A block anchored at position p is what the
runtime drafts after committing tokens 0..p-1 with x_p the last verified token:

    context  c_j = hidden_norm(fc(concat[target layer_out.{i}](j)))      j < p, same document     (T, H)
    block    [x_p, mask, ..., mask] at positions p..p+S-1, embedded with the frozen target embedding
    attention: block queries see the context rows j < p of their document and every row of their OWN
               block (non-causal inside the block); rows of other blocks are invisible
    slot t (1..L-1) is trained towards the target's own distribution at position p+t-1 (KL), weight
               exp(-(t-1)/gamma): early slots matter most, a rejection ends the cycle

L is drawn per block from `block_sizes` (mask rows past L are invisible), so one drafter serves blocks of
8 and 16. DFlash-2 adds local mixing around attention and MLP (two-tap dynamic depthwise causal conv,
zero across the block start; runtime.drafters.dflash.local_mix) and the candidate selector, trained on
the walk's conditional q_t(b | a) = softmax_b(log p_t(b) + <A(a) * H(h_t), B(b)>) with a = the true
token at p+t-1 (the anchor for slot 1) towards the same target distribution: the runtime samples slot t
from exactly this conditional, restricted to the slot's top-K.

Exported in the z-lab layout that export/drafters/dflash.py reads (no embedding, no lm_head; the
selector's codebooks without `.weight`)."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from export.drafters.dflash import default_target_layer_ids
from export.drafters.trainer import DrafterTask, TargetBatch, depth_tally, soft_cross_entropy, write_checkpoint
from export.zoo.model import MLP, RMSNorm, rotate_half


def by_slot(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, S: int, numbers: Dict[str, float],
            name: str, sampled: bool) -> List[Tuple[float, ...]]:
    """The block's held-out tally per slot 1 .. S-1 (`depth_tally` of the rows at that slot); slots 1, 4 and 8's
    greedy agreement also into `numbers` as name_s."""
    tally = [depth_tally(got[slots == s], want[slots == s], sampled) for s in range(1, S)]
    for s in (1, 4, 8):
        if s < S:
            hits, n = tally[s - 1][:2]
            numbers[f"{name}_{s}"] = hits / n if n else 0.0
    return tally


class _Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class _LocalMix(nn.Module):
    """DFlash-2's `attention_conv` / `mlp_conv`: base_kernel (in/out, tap, H) + kernel_projection (H -> in/out x
    tap x groups). Starts as the identity (tap 0 = 1, tap 1 = 0, no content-dependent delta)."""

    def __init__(self, h: int, group: int):
        super().__init__()
        base = torch.zeros(2, 2, h)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(h, 2 * 2 * (h // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)
        self.group = group

    def kernels(self, h):
        """h (..., S, H) the normed sublayer input -> (in, out) kernels, each (..., S, tap, H)."""
        dyn = self.kernel_projection(h).unflatten(-1, (2, 2, -1)).repeat_interleave(self.group, -1)
        return self.base_kernel[0] + dyn[..., 0, :, :], self.base_kernel[1] + dyn[..., 1, :, :]

    @staticmethod
    def mix(x, k):
        """out_s = k[s, 0] * x_s + k[s, 1] * x_{s-1} along the block axis (-2), x_{-1} = 0."""
        prev = F.pad(x, (0, 0, 1, 0))[..., :-1, :]
        return k[..., 0, :] * x + k[..., 1, :] * prev


class _Layer(nn.Module):
    def __init__(self, cfg, v2: bool, group: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if v2:
            self.attention_conv = _LocalMix(cfg.hidden_size, group)
            self.mlp_conv = _LocalMix(cfg.hidden_size, group)
        self.v2 = v2


class DFlashTask(DrafterTask):
    def __init__(self, kind: str, target, layers: int = 2, block_size: int = 16, block_sizes: Sequence[int] = (8, 16),
                 anchors: int = 32, mask_token_id: int = 0, gamma: float = 7.0, conv_group_size: int = 16,
                 selector_rank: int = 64, selector_top_k: int = 16, target_layer_ids: Optional[Sequence[int]] = None):
        super().__init__()
        if kind not in ("dflash", "dflash2"):
            raise ValueError(f"kind {kind!r}: expected dflash or dflash2")
        cfg = target.cfg
        h = cfg.hidden_size
        self.kind, self.cfg, self.v2 = kind, cfg, kind == "dflash2"
        self.block_size, self.block_sizes = block_size, tuple(sorted(set(block_sizes) | {block_size}))
        if min(self.block_sizes) < 2 or max(self.block_sizes) != block_size:
            raise ValueError(f"block sizes {self.block_sizes}: each >= 2 and none above block_size {block_size}")
        if self.v2 and h % conv_group_size:
            raise ValueError(f"conv_group_size {conv_group_size} does not divide hidden_size {h}")
        self.anchors, self.mask_token_id, self.gamma = anchors, mask_token_id, gamma
        self.group, self.rank, self.top_k = conv_group_size, selector_rank, selector_top_k
        self.layer_ids = tuple(target_layer_ids or default_target_layer_ids(cfg.num_hidden_layers, layers))
        self.taps = tuple(f"layer_out.{i}" for i in self.layer_ids)
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg, self.v2, conv_group_size) for _ in range(layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if self.v2:
            self.candidate_selector = nn.Module()
            self.candidate_selector.hidden_projection = nn.Linear(h, selector_rank, bias=False)
            self.candidate_selector.predecessor_codebook = nn.Parameter(0.02 * torch.randn(cfg.vocab_size, selector_rank))
            self.candidate_selector.successor_codebook = nn.Parameter(0.02 * torch.randn(cfg.vocab_size, selector_rank))
        for name, p in self.named_parameters():
            if p.dim() == 2 and "kernel_projection" not in name and "codebook" not in name:
                nn.init.normal_(p, std=0.02)

    # -- the batch's blocks ------------------------------------------------------------------------

    def _anchors(self, batch: TargetBatch):
        """-> p (B, A) anchor positions, ok (B, A) whether the anchor exists, length (B, A) its block length.
        A valid anchor has a context row and a label in its own document. Drawn from a generator seeded by
        the batch's tokens, so a batch (a pure function of (seed, step)) always gets the same blocks."""
        B, T = batch.ids.shape
        doc = batch.doc.cpu()  # drawn on the CPU generator: the same blocks on every device
        valid = torch.zeros(B, T, dtype=torch.bool)
        valid[:, 1:T - 1] = (doc[:, 1:T - 1] == doc[:, :T - 2]) & (doc[:, 1:T - 1] == doc[:, 2:]) & (doc[:, 1:T - 1] >= 0)
        g = torch.Generator().manual_seed(int(batch.ids.sum()) * 7919 + T)
        score = torch.rand(B, T, generator=g).masked_fill(~valid, -1.0)
        a = min(self.anchors, T)
        top, p = score.topk(a, dim=1)
        sizes = torch.tensor(self.block_sizes)
        length = sizes[torch.randint(len(sizes), (B, a), generator=g)]
        dev = batch.ids.device
        return p.to(dev), (top >= 0).to(dev), length.to(dev)

    def forward(self, batch: TargetBatch, collect: Optional[list] = None):
        """-> (loss, numbers); `collect`, if given, receives (anchors p, block logits (B, A, S-1, V))."""
        c = self.cfg
        B, T = batch.ids.shape
        S, nh, nkv, d = self.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        p, ok, length = self._anchors(batch)
        A = p.shape[1]
        ctx = self.hidden_norm(self.fc(torch.cat([batch.taps[t] for t in self.taps], -1)))  # (B, T, H)
        anchor_tok = batch.ids.gather(1, p)  # (B, A)
        dev = batch.ids.device
        block = torch.full((B, A, S), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = anchor_tok
        x = F.embedding(block, batch.embed.detach()).float()  # (B, A, S, H)
        slot = torch.arange(S, device=dev)
        pos_b = batch.positions.gather(1, p)[:, :, None] + slot  # (B, A, S) document-relative positions
        cos_b, sin_b = _rope(c, pos_b.reshape(B, A * S))
        cos_c, sin_c = _rope(c, batch.positions)
        # may attend: context rows j < p of the anchor's document; rows s' < L of the block itself
        doc_p = batch.doc.gather(1, p)  # (B, A)
        see_ctx = (torch.arange(T, device=dev)[None, None] < p[:, :, None]) & (batch.doc[:, None, :] == doc_p[:, :, None])
        see_blk = slot[None, None] < length[:, :, None]  # (B, A, S) key slots inside the block
        mask = torch.cat([see_ctx[:, :, None].expand(B, A, S, T).reshape(B, A * S, T),
                          torch.block_diag(*[torch.ones(S, S, dtype=torch.bool, device=dev)] * A)[None].expand(B, -1, -1)
                          & see_blk.reshape(B, 1, A * S)], -1)[:, None]  # (B, 1, A*S, T + A*S)
        for layer in self.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            if layer.v2:
                k_in, k_out = layer.attention_conv.kernels(h)
                h = _LocalMix.mix(h, k_in)
            hb = h.reshape(B, A * S, -1)
            q = _apply(a.q_norm(a.q_proj(hb).view(B, A * S, nh, d)).transpose(1, 2), cos_b, sin_b)
            kc = _apply(a.k_norm(a.k_proj(ctx).view(B, T, nkv, d)).transpose(1, 2), cos_c, sin_c)
            kb = _apply(a.k_norm(a.k_proj(hb).view(B, A * S, nkv, d)).transpose(1, 2), cos_b, sin_b)
            vc = a.v_proj(ctx).view(B, T, nkv, d).transpose(1, 2)
            vb = a.v_proj(hb).view(B, A * S, nkv, d).transpose(1, 2)
            k = torch.cat([kc, kb], 2).repeat_interleave(nh // nkv, 1)
            v = torch.cat([vc, vb], 2).repeat_interleave(nh // nkv, 1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, A*S, d)
            o = a.o_proj(y.transpose(1, 2).reshape(B, A, S, nh * d))
            x = x + (_LocalMix.mix(o, k_out) if layer.v2 else o)
            h = layer.post_attention_layernorm(x)
            if layer.v2:
                k_in, k_out = layer.mlp_conv.kernels(h)
                h = _LocalMix.mix(h, k_in)
            m = layer.mlp(h)
            x = x + (_LocalMix.mix(m, k_out) if layer.v2 else m)
        out = self.norm(x[:, :, 1:])  # (B, A, S-1, H) the draft slots
        logits = out @ batch.head.detach().T  # (B, A, S-1, V)
        if collect is not None:
            collect.append((p, logits.detach()))
        # slot t = 1..S-1 predicts x_{p+t}: the target's distribution at p+t-1
        t = torch.arange(1, S, device=dev)
        at = (p[:, :, None] + t - 1).clamp(max=T - 1)  # (B, A, S-1)
        nxt = (p[:, :, None] + t).clamp(max=T - 1)
        valid = ok[:, :, None] & (t[None, None] < length[:, :, None]) & (p[:, :, None] + t < T) \
            & (batch.doc.gather(1, nxt.flatten(1)).view_as(nxt) == doc_p[:, :, None])
        want = batch.logits.gather(1, at.flatten(1)[..., None].expand(-1, -1, batch.logits.shape[-1]))
        want = want.view(B, A, S - 1, -1)[valid]
        weight = torch.exp(-(t.float() - 1) / self.gamma)[None, None].expand(B, A, -1)[valid]
        got = logits[valid]
        norm = B * A  # the same in every process (see DrafterTask.forward)
        loss = (weight * soft_cross_entropy(got, want)).sum() / norm
        numbers: Dict[str, float] = {}
        with torch.no_grad():
            slots = t[None, None].expand(B, A, -1)[valid]
            self.tally = by_slot(got, want, slots, S, numbers, "top1", sampled=not self.training)
        if self.v2:
            # the walk's conditional after the TRUE predecessor (the anchor for slot 1)
            prev = batch.ids.gather(1, at.flatten(1)).view_as(at)  # x_{p+t-1}
            sel = self.candidate_selector
            hp = sel.hidden_projection(out)[valid]  # (n, rank)
            pair = ((sel.predecessor_codebook[prev[valid]] * hp)[:, None, :] @ sel.successor_codebook.T[None]).squeeze(1)
            cond = F.log_softmax(got.float(), -1) + pair
            loss = loss + (weight * soft_cross_entropy(cond, want)).sum() / norm
            with torch.no_grad():
                # the runtime draws slot t from this conditional: its acceptance is the walk's
                self.tally = by_slot(cond, want, slots, S, numbers, "walk1", sampled=not self.training)
        return loss, numbers

    # -- export ------------------------------------------------------------------------------------

    def official_weights(self) -> Dict[str, np.ndarray]:
        return {k: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}

    def config(self) -> Dict:
        c = self.cfg
        dcfg = {"target_layer_ids": list(self.layer_ids), "mask_token_id": self.mask_token_id,
                # edgespec's own key: every block size the drafter was trained at (bundle entries per size)
                "trained_block_sizes": list(self.block_sizes)}
        if self.v2:
            dcfg.update(conv_group_size=self.group, conv_kernel_size=2, selector_rank=self.rank,
                        selector_top_k=self.top_k)
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_hidden_layers": len(self.layers),
                "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float16",
                "block_size": self.block_size, "num_target_layers": c.num_hidden_layers, "dflash_config": dcfg}

    def export(self, out_dir: str, config: Dict = None) -> List[str]:
        """config.json (a Qwen3 config + block_size, num_target_layers, dflash_config) + model.safetensors in fp16."""
        cfg = dict(self.config(), **(config or {}))
        os.makedirs(out_dir, exist_ok=True)
        w = {k: v.astype(np.float16) for k, v in self.official_weights().items()}
        return write_checkpoint(out_dir, w, cfg)


def _rope(cfg, positions):
    """positions (B, N) -> cos, sin (B, 1, N, d) (HF layout, as the target's rotary embedding)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=positions.device)
                                     / cfg.head_dim))
    ang = positions.float()[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos()[:, None], emb.sin()[:, None]


def _apply(x, cos, sin):
    return x * cos + rotate_half(x) * sin

