"""Training EAGLE-1 and EAGLE-3 heads with the shared trainer (export/drafters/trainer.py), with the
training-time test of EAGLE-3: the head is unrolled `unroll` steps on its own outputs and step j's loss is
weighted decay^j.

Step j at position t is the draft row of depth j whose root row sits at position t - j: its feature is
step j-1's output at t-1, its token x_{t+1}, and it attends to the step-0 rows (target features) at
positions <= t - j and to the step-i rows at position t - j + i, i = 1..j (its ancestors and itself) —
the attention the runtime drafter's chain rows have. Its label is the target's own distribution at t+1.
EAGLE-1 adds the official feature regression at step 0 (smooth L1 of the output against the target's
final-normed hidden state at t+1). Exported in the official layouts that export/drafters/eagle.py loads."""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from export.drafters.eagle import default_tap_layers, tap_collision
from export.drafters.trainer import DrafterTask, TargetBatch, depth_tally, soft_cross_entropy, write_checkpoint
from export.zoo.model import MLP, RMSNorm, rope_cos_sin, rotate_half


class _Attention(nn.Module):
    def __init__(self, cfg, attn_in: int):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(attn_in, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(attn_in, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(attn_in, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)


class EagleTask(DrafterTask):
    def __init__(self, kind: str, target, unroll: int = 4, decay: float = 0.8):
        super().__init__()
        cfg = target.cfg
        self.kind, self.cfg, self.unroll, self.decay = kind, cfg, unroll, decay
        h = cfg.hidden_size
        n = cfg.num_hidden_layers
        self.tap_layers = default_tap_layers(n)
        collision = tap_collision(self.tap_layers, n) if kind == "eagle3" else None
        if collision:  # trains and runs, but on a shallow target the user should know the head is not EAGLE-3's
            print(f"warning: {collision}", file=sys.stderr, flush=True)
        self.taps = ("final_norm",) if kind == "eagle" else tuple(f"layer_in.{i}" for i in self.tap_layers) + ("final_norm",)
        self.fc = nn.Linear(2 * h if kind == "eagle" else 3 * h, h, bias=kind == "eagle")
        self.self_attn = _Attention(cfg, h if kind == "eagle" else 2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if kind == "eagle3":
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
            self.lm_head.weight.data.copy_(head.detach())  # start from the target's head (full draft vocabulary)

    def _qkv(self, feat, emb, cos, sin):
        """feat, emb (B, T, H) -> residual x, q (B, nh, T, d), k, v (B, nh, T, d) with GQA repeated."""
        c, a = self.cfg, self.self_attn
        if self.kind == "eagle":
            x = self.fc(torch.cat([emb, feat], -1))
            inp = x
        else:
            hn = self.hidden_norm(feat)
            inp = torch.cat([self.input_layernorm(emb), hn], -1)
            x = feat
        B, T, _ = x.shape
        q = a.q_proj(inp).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(inp).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(inp).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        return x, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def _logits(self, out, head):
        return out @ head.T if self.kind == "eagle" else self.lm_head(self.norm(out))

    def forward(self, batch: TargetBatch, collect: Optional[list] = None):
        """-> (loss, numbers); `collect`, if given, receives each step's (B, T, V) logits (for tests)."""
        B, T = batch.ids.shape
        c = self.cfg
        cos, sin = rope_cos_sin(c, batch.positions)
        doc = batch.doc
        if self.kind == "eagle":
            feat = batch.taps["final_norm"]
        else:
            feat = self.fc(torch.cat([batch.taps[f"layer_in.{i}"] for i in self.tap_layers], -1))
        nxt = torch.zeros_like(batch.ids)
        nxt[:, :-1] = batch.ids[:, 1:]
        emb = F.embedding(nxt, batch.embed)  # (B, T, H) embed(x_{t+1})
        scale = c.head_dim ** -0.5
        dev = doc.device
        same = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)  # (B, T, T)
        idx = torch.arange(T, device=dev)
        keys: List = []  # per step: (k, v) (B, nh, T, d)
        loss = feat.new_zeros(())
        numbers: Dict[str, float] = {}
        self.tally = []
        prev = None
        for j in range(self.unroll):
            if j > 0:  # own output at t-1 becomes the feature at t
                feat = torch.cat([prev[:, :1] * 0, prev[:, :-1]], 1)
            x, q, k, v = self._qkv(feat, emb, cos, sin)
            keys.append((k, v))
            s0 = (q @ keys[0][0].transpose(-1, -2)) * scale  # (B, nh, T, T) against the target-feature rows
            allow0 = same & (idx[None, :] <= idx[:, None] - j)[None]
            if j == 0:  # padding rows see themselves: no row of all -inf (NaN gradients)
                allow0 = allow0 | torch.eye(T, dtype=torch.bool, device=dev)[None]
            s0 = s0.masked_fill(~allow0[:, None], float("-inf"))
            diag, vals = [], []
            for i in range(1, j + 1):  # ancestors: step i at position t - j + i
                ki, vi = keys[i]
                shift = j - i
                ks = torch.cat([ki[:, :, :1].expand(-1, -1, shift, -1) * 0, ki[:, :, :T - shift]], 2) if shift else ki
                vs = torch.cat([vi[:, :, :1].expand(-1, -1, shift, -1) * 0, vi[:, :, :T - shift]], 2) if shift else vi
                diag.append(((q * ks).sum(-1) * scale)[..., None])
                vals.append(vs)
            scores = torch.cat([s0] + diag, -1)
            probs = torch.softmax(scores, -1).nan_to_num(0.0)
            y = probs[..., :T] @ keys[0][1]
            for i, vs in enumerate(vals):
                y = y + probs[..., T + i:T + i + 1] * vs
            out = x + self.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
            out = out + self.mlp(self.post_attention_layernorm(out))
            prev = out
            # valid: the root t-j, the position t and the label position t+1 lie in one document
            valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
            valid[:, j:T - 1] = (doc[:, :T - 1 - j] == doc[:, j + 1:]) & (doc[:, j + 1:] >= 0)
            logits = self._logits(out, batch.head.detach())
            if collect is not None:
                collect.append(logits.detach())
            got = logits[valid]
            want = batch.logits[:, 1:][valid[:, :T - 1]]
            loss = loss + self.decay ** j * soft_cross_entropy(got, want).sum() / (B * T)
            if j == 0 and self.kind == "eagle":
                reg = F.smooth_l1_loss(out[valid], batch.taps["final_norm"][:, 1:][valid[:, :T - 1]], reduction="sum")
                loss = loss + reg / (B * T * c.hidden_size) * 10.0
            with torch.no_grad():
                self.tally.append(depth_tally(got, want, sampled=not self.training))
                numbers[f"top1_{j}"] = self.tally[-1][0] / len(want) if len(want) else 0.0
        return loss, numbers

    def official_weights(self) -> Dict[str, np.ndarray]:
        p = "layers.0." if self.kind == "eagle" else "midlayer."
        out = {}
        for name, t in self.state_dict().items():
            top = name.split(".")[0]
            if top in ("self_attn", "mlp", "post_attention_layernorm", "input_layernorm", "hidden_norm"):
                name = p + name
            out[name] = t.detach().float().cpu().numpy()
        if self.kind == "eagle3":
            out["d2t"] = np.zeros(self.cfg.vocab_size, np.int64)  # full draft vocabulary: the identity map
            out["t2d"] = np.ones(self.cfg.vocab_size, bool)
        return out

    def export(self, out_dir: str, config: Dict = None) -> List[str]:
        """config.json (a one-layer Llama config; EAGLE-1 `bias`, EAGLE-3 `draft_vocab_size`) + model.safetensors
        in fp16 (the maps stay integers)."""
        c = self.cfg
        cfg = {"architectures": ["LlamaForCausalLM"] if self.kind == "eagle" else ["LlamaForCausalLMEagle3"],
               "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
               "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
               "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
               "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
               "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "float16"}
        cfg.update({"bias": True} if self.kind == "eagle" else {"draft_vocab_size": c.vocab_size})
        cfg.update(config or {})
        os.makedirs(out_dir, exist_ok=True)
        w = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in self.official_weights().items()}
        return write_checkpoint(out_dir, w, cfg)
