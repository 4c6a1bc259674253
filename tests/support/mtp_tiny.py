"""A tiny HF checkpoint with k DeepSeek-V3 MTP modules (model.layers.{N+i}.*, `num_nextn_predict_layers: k`),
random weights, the tiny BPE tokenizer: written in the official key layout with the real safetensors format."""
from __future__ import annotations

import json
import os
from typing import Dict

import numpy as np
import torch

from export.zoo.model import LlamaConfig, LlamaLM, hf_state_dict
from runtime.model.tensors import write_safetensors
from tests.support.tiny_bundle import make_tokenizer

LAYERS = 2


def mtp_weights(vocab: int, modules: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Target + `modules` MTP modules: module i > 0 is module 0 with its own random perturbation."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    model = LlamaLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    w = {k: v.detach().numpy().astype(np.float32) for k, v in hf_state_dict(model).items()}
    rng = np.random.default_rng(seed)
    first = f"model.layers.{LAYERS}."
    for i in range(1, modules):
        for k, v in list(w.items()):
            if k.startswith(first):
                w[f"model.layers.{LAYERS + i}." + k[len(first):]] = (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
    w["config"] = cfg.hf_dict() | {"num_nextn_predict_layers": modules}
    return w


def write_mtp_checkpoint(root: str, modules: int, seed: int = 0, drop: str = "") -> str:
    """An HF directory (config.json, model.safetensors, tokenizer.json) under root; `drop`: a key left out."""
    path = os.path.join(root, f"mtp{modules}")
    os.makedirs(path, exist_ok=True)
    vocab = make_tokenizer(os.path.join(path, "tokenizer.json"))
    w = mtp_weights(vocab, modules, seed)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(w.pop("config"), f)
    w.pop(drop, None)
    write_safetensors(os.path.join(path, "model.safetensors"), w)
    return path
