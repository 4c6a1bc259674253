"""The numpy reference backend: the correctness oracle every other backend and drafter is tested
against, and a backend that always runs (float32, batch 1, explicit positions and masks).

Weights use HF names ("model.layers.0.self_attn.q_proj.weight", ...) so a checkpoint's safetensors
load as they are."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from runtime.backends.base import CacheRows, ForwardResult, parse_tap
from runtime.errors import BundleError
from runtime.memory.kv import CacheShape, KVCache
from runtime.model.layers import (causal_mask, decoder_layer, decoder_layer_weight_names, rms_norm, rope_cos_sin,
                            rope_inv_freq)
from runtime.model.spec import ModelSpec


def cache_shape(spec: ModelSpec) -> CacheShape:
    return CacheShape(spec.num_layers, spec.num_kv_heads, spec.head_dim)


def required_weight_names(spec: ModelSpec) -> list:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        names += decoder_layer_weight_names(f"model.layers.{i}.", spec)
    return names


def load_float32(weights: Mapping[str, np.ndarray], names: Sequence[str], source: str) -> Dict[str, np.ndarray]:
    missing = [n for n in names if n not in weights]
    if missing:
        raise BundleError(f"{source}: missing weights {missing[:4]}{' ...' if len(missing) > 4 else ''}; "
                          "the checkpoint does not match its config")
    return {n: np.ascontiguousarray(weights[n], dtype=np.float32) for n in names}


class NumpyTarget(CacheRows):
    """A decoder-only model with a KV cache, implementing runtime.backends.base.TargetBackend."""

    name = "numpy_ref"

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], cache: KVCache, source: str = "weights"):
        self.spec = spec
        self.w = load_float32(weights, required_weight_names(spec), source)
        self.lm_head = self.w["model.embed_tokens.weight"] if spec.tie_word_embeddings else self.w["lm_head.weight"]
        self.inv_freq = rope_inv_freq(spec)
        self.cache = cache

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.w["model.embed_tokens.weight"][tokens]

    def forward(self, tokens, positions, mask: Optional[np.ndarray] = None, taps: Sequence[str] = (),
                all_logits: bool = True) -> ForwardResult:
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        t = tokens.shape[0]
        start = self.cache.length
        self.cache.check_room(t)
        if mask is None:
            mask = causal_mask(start, t)
        want = {name: parse_tap(name, self.spec.num_layers) for name in taps}
        got: Dict[str, np.ndarray] = {}
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        x = self.embed(tokens)  # (T, H)
        for i in range(self.spec.num_layers):
            if f"layer_in.{i}" in want:
                got[f"layer_in.{i}"] = x
            x = decoder_layer(self.w, f"model.layers.{i}.", self.spec, x, cos, sin,
                              self.cache.k[:, i], self.cache.v[:, i], start, mask)
            if f"layer_out.{i}" in want:
                got[f"layer_out.{i}"] = x
        h = rms_norm(x, self.w["model.norm.weight"], self.spec.rms_norm_eps)
        if "final_norm" in want:
            got["final_norm"] = h
        self.cache.length = start + t
        return ForwardResult(logits=(h if all_logits else h[-1:]) @ self.lm_head.T, taps=got)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        self.cache.keep(start, rows)

