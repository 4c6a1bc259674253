"""Tiny EAGLE-1 and EAGLE-3 checkpoints in the official layouts (SafeAILab/EAGLE, vLLM, speculators), with
random weights, written with the real safetensors format for a given target spec."""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np

from runtime.model.spec import ModelSpec
from runtime.model.tensors import write_safetensors


def _layer(rng, spec: ModelSpec, prefix: str, attn_in: int, scale: float) -> Dict[str, np.ndarray]:
    h, q, kv, i = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size

    def m(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return {prefix + "self_attn.q_proj.weight": m(q, attn_in), prefix + "self_attn.k_proj.weight": m(kv, attn_in),
            prefix + "self_attn.v_proj.weight": m(kv, attn_in), prefix + "self_attn.o_proj.weight": m(h, q),
            prefix + "mlp.gate_proj.weight": m(i, h), prefix + "mlp.up_proj.weight": m(i, h),
            prefix + "mlp.down_proj.weight": m(h, i),
            prefix + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}


def llama_config(spec: ModelSpec, **extra) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden_size,
           "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
           "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": 1,
           "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta, "vocab_size": spec.vocab_size,
           "max_position_embeddings": spec.max_position_embeddings}
    cfg.update(extra)
    return cfg


def write_checkpoint(path: str, config: dict, weights: Dict[str, np.ndarray]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(path, "model.safetensors"), weights)
    return path


def eagle1_checkpoint(path: str, target: ModelSpec, seed: int = 0, bias: Optional[bool] = True,
                      speculators: bool = False, scale: float = 0.15) -> str:
    """EAGLE-1 head. bias None = config without the `bias` key (the default, true, applies)."""
    rng = np.random.default_rng(seed)
    h = target.hidden_size
    w = {"fc.weight": (scale * rng.standard_normal((h, 2 * h))).astype(np.float32)}
    with_bias = True if bias is None else bias
    if with_bias:
        w["fc.bias"] = (scale * rng.standard_normal(h)).astype(np.float32)
    w.update(_layer(rng, target, "layers.0.", h, scale))
    if speculators:
        cfg = {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator"], "layernorms": False,
               "fusion_bias": with_bias, "transformer_layer_config": llama_config(target)}
    else:
        cfg = llama_config(target, **({} if bias is None else {"bias": bias}))
    return write_checkpoint(path, cfg, w)


def eagle3_checkpoint(path: str, target: ModelSpec, seed: int = 0, draft_vocab: Optional[int] = None,
                      layout: str = "official", scale: float = 0.15) -> str:
    """EAGLE-3 head; draft_vocab < V gives a reduced vocabulary (every other target id) with d2t / t2d.
    layout: official (midlayer., d2t), vllm (layers.0., draft_id_to_target_id), speculators (layers.0., d2t,
    config wrapped in transformer_layer_config)."""
    rng = np.random.default_rng(seed)
    h, v = target.hidden_size, target.vocab_size
    dv = draft_vocab or v
    mid = "midlayer." if layout == "official" else "layers.0."
    w = {"fc.weight": (scale * rng.standard_normal((h, 3 * h))).astype(np.float32),
         "norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
         "lm_head.weight": (scale * rng.standard_normal((dv, h))).astype(np.float32),
         mid + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
         mid + "hidden_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
    w.update(_layer(rng, target, mid, 2 * h, scale))
    if dv < v:
        ids = np.sort(rng.choice(v, dv, replace=False))
        w["draft_id_to_target_id" if layout == "vllm" else "d2t"] = (ids - np.arange(dv)).astype(np.int64)
        t2d = np.zeros(v, bool)
        t2d[ids] = True
        if layout != "vllm":
            w["t2d"] = t2d
    if layout == "speculators":
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": dv,
               "norm_before_residual": False, "target_hidden_size": h, "transformer_layer_config": llama_config(target),
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
    else:
        cfg = llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
    return write_checkpoint(path, cfg, w)
