"""Read an HF model directory (config.json + safetensors, single or sharded; fp32/fp16/bf16) of the
Llama, Qwen2 or Qwen3 family into a ModelSpec and numpy weights (and the dtype each tensor is stored in)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from runtime.errors import BundleError
from runtime.model_spec import ModelSpec
from runtime.tensors import read_safetensors, safetensors_dtypes


@dataclass
class HFCheckpoint:
    path: str
    config: Dict
    spec: ModelSpec
    weights: Dict[str, np.ndarray]  # HF names; dtype as stored (bf16 widened to float32)
    tokenizer_file: Optional[str]
    dtypes: Dict[str, str]  # HF name -> dtype as stored ("BF16", "F16", "F32", ...)

    @property
    def bf16_names(self) -> list:
        """Tensors stored as bf16: read widened to float32, written back as bf16 (half the bytes)."""
        return [n for n in self.weights if self.dtypes.get(n) == "BF16"]


def shard_files(path: str) -> list:
    """The safetensors files of a model dir, following `model.safetensors.index.json` when sharded."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not shards:
        if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(path)):
            raise BundleError(f"{path}: only pickle checkpoints (.bin/.pt) found; edgespec reads safetensors. "
                              "Convert with `transformers` save_pretrained(safe_serialization=True) first.")
        raise BundleError(f"{path}: no .safetensors files found")
    files = [os.path.join(path, shard) for shard in shards]
    for full in files:
        if not os.path.isfile(full):
            raise BundleError(f"{full}: shard named in the index is missing")
    return files


def read_weights(path: str) -> Dict[str, np.ndarray]:
    """All safetensors tensors of a model dir, following `model.safetensors.index.json` when sharded."""
    weights: Dict[str, np.ndarray] = {}
    for full in shard_files(path):
        weights.update(read_safetensors(full))
    return weights


def read_hf_checkpoint(path: str) -> HFCheckpoint:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise BundleError(f"{path}: no config.json; expected an HF model directory")
    with open(cfg_path) as f:
        config = json.load(f)
    spec = ModelSpec.from_hf_config(config, source=cfg_path)
    weights = read_weights(path)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a tied head is the embedding; keep one copy
    dtypes: Dict[str, str] = {}
    for full in shard_files(path):
        dtypes.update(safetensors_dtypes(full))
    tok = os.path.join(path, "tokenizer.json")
    return HFCheckpoint(path, config, spec, weights, tok if os.path.isfile(tok) else None, dtypes)
