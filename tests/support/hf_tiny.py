"""Tiny random HF models (transformers, torch CPU) of the three families, for oracle tests."""
from __future__ import annotations

import numpy as np
import torch
import transformers

from runtime.model.spec import ModelSpec

FAMILY_CONFIGS = {
    "llama": dict(model_type="llama", rope_scaling=None, tie_word_embeddings=False),
    "llama3_rope": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear_rope": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False),
}


def tiny_hf_model(family: str, seed: int = 0, num_layers: int = 3):
    """(torch model, ModelSpec, numpy weights) for a random tiny model with GQA."""
    opts = dict(FAMILY_CONFIGS[family])
    model_type = opts.pop("model_type")
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[model_type]
    cls_model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    rope_scaling = opts.pop("rope_scaling", None)
    kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0, **opts)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling, rope_theta=10000.0)
    cfg = cls_cfg(**kwargs)
    torch.manual_seed(seed)
    model = cls_model(cfg).eval().float()
    with torch.no_grad():  # larger-than-default weights so that errors are not hidden by near-uniform outputs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        if cfg.tie_word_embeddings:
            model.tie_weights()
    spec = ModelSpec.from_hf_config(cfg.to_dict())
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model, spec, weights


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
