"""The decoder maths in numpy float32: RMSNorm, rotary embeddings, GQA attention with an explicit mask,
SwiGLU, one decoder layer. Shared by the reference target and the numpy drafters (MTP, EAGLE, draft model).

Everything stays float32: a single float64 scalar would promote the whole forward (NumPy 2) and
make it ~9x slower, so constants are cast explicitly."""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from runtime.model.spec import ModelSpec

Weights = Dict[str, np.ndarray]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def rope_inv_freq(spec: ModelSpec) -> np.ndarray:
    """Inverse frequencies (head_dim/2,), with linear or llama3 scaling applied as HF does."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = spec.rope_scaling
    if rs.kind == "linear":
        inv = inv / rs.factor
    elif rs.kind == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray):
    """cos, sin of shape (T, head_dim) in HF's rotate-half layout."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # (T, d/2)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, heads, d); rotate-half convention (HF Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """GQA attention. q (T, nh, d), k/v (S, nkv, d), mask (T, S) bool (True = may attend) -> (T, nh*d)."""
    t, nh, d = q.shape
    s, nkv, _ = k.shape
    g = nh // nkv
    qg = q.reshape(t, nkv, g, d).transpose(1, 2, 0, 3).reshape(nkv, g * t, d)  # (nkv, g*T, d)
    scores = qg @ k.transpose(1, 2, 0)  # (nkv, g*T, S)
    scores *= np.float32(1.0 / np.sqrt(d))
    scores = scores.reshape(nkv, g, t, s)
    scores = np.where(mask[None, None], scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs.reshape(nkv, g * t, s) @ v.transpose(1, 0, 2)  # (nkv, g*T, d)
    return out.reshape(nkv, g, t, d).transpose(2, 0, 1, 3).reshape(t, nh * d)


def decoder_layer_weight_names(p: str, spec: ModelSpec) -> list:
    """The weights `decoder_layer` reads under prefix `p` for this family."""
    names = [p + s for s in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    if spec.qkv_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if spec.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def decoder_layer(
    w: Weights, p: str, spec: ModelSpec, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
    k_cache: np.ndarray, v_cache: np.ndarray, start: int, mask: np.ndarray,
    attn_input: Optional[np.ndarray] = None,
) -> np.ndarray:
    """One pre-norm decoder layer over T new tokens.

    x (T, H) is the residual stream; `p` the weight-name prefix ("model.layers.3.").
    k_cache/v_cache (max_pos, nkv, d) views: the new K/V are written to rows start..start+T and
    attention runs over rows 0..start+T under `mask` (T, start+T). `attn_input`, if given, replaces
    input_layernorm(x) as the attention input (EAGLE-3 feeds a 2H concat there)."""
    t = x.shape[0]
    nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    h = rms_norm(x, w[p + "input_layernorm.weight"], spec.rms_norm_eps) if attn_input is None else attn_input
    q = h @ w[p + "self_attn.q_proj.weight"].T
    k = h @ w[p + "self_attn.k_proj.weight"].T
    v = h @ w[p + "self_attn.v_proj.weight"].T
    if spec.qkv_bias:
        q = q + w[p + "self_attn.q_proj.bias"]
        k = k + w[p + "self_attn.k_proj.bias"]
        v = v + w[p + "self_attn.v_proj.bias"]
    q = q.reshape(t, nh, d)
    k = k.reshape(t, nkv, d)
    v = v.reshape(t, nkv, d)
    if spec.qk_norm:
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], spec.rms_norm_eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], spec.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_cache[start:start + t] = k
    v_cache[start:start + t] = v
    attn = attention(q, k_cache[:start + t], v_cache[:start + t], mask)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    up = h @ w[p + "mlp.up_proj.weight"].T
    return x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def causal_mask(cache_len: int, t: int) -> np.ndarray:
    """(T, cache_len+T) bool: every new token sees the whole cache and the new tokens up to itself."""
    return np.concatenate([np.ones((t, cache_len), bool), np.tril(np.ones((t, t), bool))], axis=1)
