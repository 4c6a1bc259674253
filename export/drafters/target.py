"""The frozen target a drafter is distilled from, in torch: any model `edgespec bundle` accepts (Llama, Qwen2 with
q/k/v biases, Qwen3 with per-head q/k RMSNorm; tied or untied head; default, linear or llama3 rope), read with the
bundle's own HF reader (export/bundle/hf_reader.py), so the trainer and the bundle see one model.

Numerics follow transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (tested against them):

    x = embed(ids)
    per layer:  q, k, v = proj(norm(x)) (+ bias: Qwen2);  q, k = rms(q), rms(k) per head (Qwen3);  rope(q, k)
                x = x + o(attn(q, k, v));  x = x + down(silu(gate(norm(x))) * up(norm(x)))
    logits = head(norm(x))      head = lm_head, or the embedding when tied

An MTP module stored after the last layer (model.layers.N, DeepSeek-V3 keys) is not part of the target and is
left out. The drafter tasks read `cfg` by the zoo model's field names (hidden_size, num_hidden_layers, ...)."""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from export.zoo.model import MLP, RMSNorm, rotate_half
from runtime.model.spec import ModelSpec


@dataclass(frozen=True)
class TargetConfig:
    """The target's architecture under the names the drafter tasks read (those of export.zoo.model.LlamaConfig)."""
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @staticmethod
    def of(spec: ModelSpec) -> "TargetConfig":
        return TargetConfig(spec.family, spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers,
                            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps, spec.rope_theta,
                            spec.max_position_embeddings, spec.tie_word_embeddings, spec.qkv_bias, spec.qk_norm)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: Optional[List[torch.Tensor]] = None):
        """x (B, T, H); mask None (causal) or bool (B, 1, T, S) over all S keys (cached and new); cache: [k, v] of
        earlier positions, extended in place (with mask None: T == 1 or the cache empty)."""
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:  # Qwen3: per head, before rope
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, T, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        causal = mask is None
        if cache is not None:
            if cache:
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
                causal = T > 1  # one new row sees every cached row
            cache[:] = [k, v]
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1) if mask is None else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetLM(nn.Module):
    """The frozen target (see the module doc). `fingerprint` identifies its weights for the feature cache."""

    def __init__(self, spec: ModelSpec, fingerprint: str = ""):
        super().__init__()
        from runtime.model.layers import rope_inv_freq

        cfg = TargetConfig.of(spec)
        self.cfg, self.spec, self.fingerprint = cfg, spec, fingerprint
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the runtime's inverse frequencies (linear / llama3 scaling as HF applies them)
        self.register_buffer("inv_freq", torch.from_numpy(rope_inv_freq(spec)), persistent=False)

    def rope(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, head_dim) in HF's rotate-half layout, float32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()  # (B, T, d/2)
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def head(self, x):
        return F.linear(x, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def forward(self, ids, positions=None, mask=None):
        """ids (B, T) -> (logits (B, T, V), h (B, T, H) = last layer output before the final norm)."""
        B, T = ids.shape
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        cos, sin = self.rope(positions)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), mask)
        return self.head(self.norm(x)), x

    @torch.no_grad()
    def step(self, ids: torch.Tensor, start: int, caches: List[list]) -> torch.Tensor:
        """Generation with a KV cache, one row: ids (1, T) at positions start.. -> logits (V,) of the last one."""
        T = ids.shape[1]
        cos, sin = self.rope(torch.arange(start, start + T, device=ids.device)[None])
        x = self.embed_tokens(ids)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), None, cache)
        return self.head(self.norm(x[:, -1]))[0].float()


def fingerprint(path: str) -> str:
    """A hash naming the target's weights: config.json's bytes and, per safetensors shard, its name, size and
    its first and last MiB (cheap for a 16 GB model; a re-saved or fine-tuned checkpoint changes them)."""
    from export.bundle.hf_reader import shard_files

    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for full in shard_files(path):
        size = os.path.getsize(full)
        h.update(f"{os.path.basename(full)}:{size}".encode())
        with open(full, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def load_target(path: str, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> TargetLM:
    """The HF directory `path` as a frozen TargetLM on `device` (float32 on CPU; bf16 on a GPU that has it,
    else fp16), read with the bundle's reader; BundleError (one line) if the bundle would refuse it too."""
    from export.bundle.builder import split_mtp
    from export.bundle.hf_reader import read_hf_checkpoint
    from runtime.errors import BundleError

    ck = read_hf_checkpoint(path)
    body, _mtp = split_mtp(ck.weights, ck.spec.num_layers)
    model = TargetLM(ck.spec, fingerprint(path))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mapped arrays: copied into the parameters at once
        for name, p in model.named_parameters():
            hf = name if name.startswith("lm_head.") else "model." + name
            if hf not in body:
                raise BundleError(f"{path}: no tensor {hf} (a {ck.spec.family} model with qkv_bias="
                                  f"{ck.spec.qkv_bias}, qk_norm={ck.spec.qk_norm} has one); the checkpoint does not "
                                  "match its config.json")
            p.copy_(torch.from_numpy(np.ascontiguousarray(body.pop(hf), dtype=np.float32)))
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else (
            torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def eos_ids(path: str) -> Tuple[int, ...]:
    """The ids that end an answer, as the bundle records them (zoo tokens included for the zoo's tokenizer)."""
    from export.bundle.prompts import defaults
    from runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(os.path.join(path, "tokenizer.json"))
    d, _ = defaults(path, tok)
    return tuple(i for t in d.get("eos_tokens", []) if (i := tok.token_to_id(t)) is not None)
