"""A small Llama (HF numerics) with an optional DeepSeek-V3-style MTP module, and its HF checkpoint I/O.

Numerics match `transformers.LlamaForCausalLM` exactly: RMSNorm (fp32 variance), default rotary embedding with
`rope_theta` (rotate-half layout), grouped-query attention, SwiGLU MLP, optional tied embeddings.

MTP (DeepSeek-V3 convention, module index N = num_hidden_layers):
    h'_t = eh_proj(concat[enorm(emb(x_{t+1})), hnorm(h_t)])     # embedding FIRST; h_t = last layer output, pre-norm
    h''  = decoder_layer(h')                                    # rotary position of h_t
    logits(x_{t+2}) = head(shared_head.norm(h''))                # head = the (tied) embedding
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 3072
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 10
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    num_nextn_predict_layers: int = 0  # 1 = the target ships a DeepSeek-V3 MTP module

    def hf_dict(self) -> dict:
        d = asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 attention_bias=False, mlp_bias=False, attention_dropout=0.0, initializer_range=0.02,
                 torch_dtype="float16", use_cache=True, rope_scaling=None, pretraining_tp=1)
        if not self.num_nextn_predict_layers:
            d.pop("num_nextn_predict_layers")
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(cfg: LlamaConfig, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) int -> cos, sin (B, 1, T, head_dim), HF default rope layout (freqs duplicated)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=positions.device)
                                     / cfg.head_dim))
    freqs = positions.float()[..., None] * inv  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, d)
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPModule(nn.Module):
    """DeepSeek-V3 multi-token-prediction module; its head is the model's (tied) output head."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, emb_next, h, cos, sin, mask):
        """emb_next (B, T, H) = emb(x_{t+1}); h (B, T, H) = target h_t pre-norm -> hidden (B, T, H) after norm."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        return self.shared_head_norm(self.layer(x, cos, sin, mask))


class LlamaLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPModule(cfg) if cfg.num_nextn_predict_layers else None
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style scaled init of residual projections
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def head(self, x):
        return F.linear(x, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def forward(self, ids, positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None):
        """ids (B, T) -> (logits (B, T, V), h (B, T, H) = last layer output before the final norm).

        mask: None (plain causal) or a bool (B, 1, T, T) "may attend" mask (packed documents)."""
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T).expand(B, T)
        cos, sin = rope_cos_sin(self.cfg, positions)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.head(self.norm(x)), x

    def mtp_logits(self, h, next_ids, positions: Optional[torch.Tensor] = None, mask=None):
        """h (B, T, H) at positions t, next_ids (B, T) = x_{t+1} -> logits (B, T, V) for x_{t+2}."""
        B, T = next_ids.shape
        if positions is None:
            positions = torch.arange(T).expand(B, T)
        cos, sin = rope_cos_sin(self.cfg, positions)
        return self.head(self.mtp(self.embed_tokens(next_ids), h, cos, sin, mask))

    def num_params(self, include_mtp: bool = True) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if include_mtp or not n.startswith("mtp."))


# ---- HF checkpoint I/O -------------------------------------------------------------------------------------------

def hf_state_dict(model: LlamaLM) -> Dict[str, torch.Tensor]:
    """Our parameter names -> HF Llama / DeepSeek-V3 MTP key names."""
    n = model.cfg.num_hidden_layers
    out = {}
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            rest = name[len("mtp."):]
            if rest.startswith("layer."):
                rest = rest[len("layer."):]
            elif rest.startswith("shared_head_norm."):
                rest = "shared_head.norm." + rest[len("shared_head_norm."):]
            key = f"model.layers.{n}.{rest}"
        elif name.startswith("lm_head."):
            key = name
        else:
            key = "model." + name
        out[key] = t
    return out


def save_hf(model: LlamaLM, out_dir: str, tokenizer_json: Optional[str] = None) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in hf_state_dict(model).items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.cfg.hf_dict(), f, indent=2, sort_keys=True)
    if tokenizer_json is not None:
        with open(tokenizer_json) as src, open(os.path.join(out_dir, "tokenizer.json"), "w") as dst:
            dst.write(src.read())


def load_hf(path: str, dtype=torch.float32) -> LlamaLM:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    fields = LlamaConfig.__dataclass_fields__
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k in fields})
    model = LlamaLM(cfg)
    sd = load_file(os.path.join(path, "model.safetensors"))
    ours = {}
    names = dict(zip(hf_state_dict(model), model.state_dict()))  # same order: HF key -> our name
    for key, t in sd.items():
        ours[names[key]] = t.to(dtype)
    model.load_state_dict(ours)
    return model.to(dtype).eval()
