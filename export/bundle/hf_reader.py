"""Read an HF model directory (config.json + safetensors, single or sharded; fp32/fp16/bf16) of the
Llama, Qwen2 or Qwen3 family into a ModelSpec and numpy weights (and the dtype each tensor is stored in),
and its prompt format: chat template, special tokens and the tokens that end an answer."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from runtime.errors import BundleError
from runtime.model.spec import ModelSpec
from runtime.model.tensors import read_safetensors, safetensors_dtypes


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


@dataclass
class HFPrompts:
    """What an HF directory says about its prompts (see `read_hf_prompts`)."""
    chat_template: str  # Jinja source; "" when the model has none (a base model)
    chat_template_from: str  # the file it was read from
    special_tokens: Dict[str, str]  # bos_token, eos_token, pad_token, unk_token as strings
    eos_tokens: List[str]  # every token that ends an answer, as a string of the tokenizer


def _json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(d, dict):
        raise BundleError(f"{path}: expected a JSON object")
    return d


def _token_string(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: Any) -> List[int]:
    return [int(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


def read_chat_template(path: str) -> tuple:
    """(template, file) of an HF directory: chat_template.jinja (how transformers saves it now), else
    chat_template.json, else tokenizer_config.json's `chat_template` (a string, or a list of named
    templates of which 'default' is used). ("", "") when there is none."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), jinja
    for name in ("chat_template.json", "tokenizer_config.json"):
        full = os.path.join(path, name)
        t = _json(full).get("chat_template")
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            if "default" not in named:
                raise BundleError(f"{full}: chat_template lists templates {sorted(map(str, named))} but none is "
                                  "'default'; pass the one to use with `edgespec bundle --target DIR --out DIR --chat-template FILE`")
            t = named["default"]
        if isinstance(t, str) and t:
            return t, full
    return "", ""


def read_hf_prompts(path: str, tokenizer) -> HFPrompts:
    """The prompt facts of an HF directory. EOS: tokenizer_config.json's eos_token, then every id of
    generation_config.json's and config.json's eos_token_id (an int or a list), as strings of `tokenizer`
    (anything with id_to_token)."""
    tok_cfg = _json(os.path.join(path, "tokenizer_config.json"))
    special = {k: s for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if (s := _token_string(tok_cfg.get(k))) is not None}
    eos = [special["eos_token"]] if "eos_token" in special else []
    for name in ("generation_config.json", "config.json"):
        for i in _ids(_json(os.path.join(path, name)).get("eos_token_id")):
            token = tokenizer.id_to_token(i)
            if token is None:
                raise BundleError(f"{os.path.join(path, name)}: eos_token_id {i} is not a token of the tokenizer "
                                  f"({tokenizer.vocab_size} tokens); fix the id, or the tokenizer does not belong "
                                  "to this model")
            eos.append(token)
    template, source = read_chat_template(path)
    return HFPrompts(template, source, special, list(dict.fromkeys(eos)))
