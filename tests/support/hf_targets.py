"""Tiny random HF target directories of the three families `edgespec bundle` accepts, each with a tokenizer, a chat
template in its family's style and EOS tokens: Qwen3 (q/k norms, untied head), Qwen2 (q/k/v biases, tied head) and
Llama (untied head, Llama-3 template). For the drafter trainer's tests (tests/export/drafters/)."""
from __future__ import annotations

import json
import os

import torch
import transformers

from tests.support.chat_checkpoints import (LLAMA3_SPECIAL, LLAMA3_TEMPLATE, QWEN3_SPECIAL, QWEN3_TEMPLATE,
                                            save_tokenizer, write_json)

FAMILIES = ("qwen3", "qwen2", "llama")


def save_target(root: str, family: str, num_layers: int = 4, seed: int = 0) -> str:
    """root/family: config.json + model.safetensors + tokenizer.json + chat template + generation_config.json."""
    path = os.path.join(root, family)
    os.makedirs(path)
    special = LLAMA3_SPECIAL if family == "llama" else QWEN3_SPECIAL
    vocab = save_tokenizer(os.path.join(path, "tokenizer.json"), special)
    ids = {t: i for i, t in enumerate(special)}
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                  rms_norm_eps=1e-6)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, bos_token_id=ids["<|begin_of_text|>"],
                                       eos_token_id=ids["<|end_of_text|>"])
        model = transformers.LlamaForCausalLM(cfg)
        tok_cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
        gen_eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    else:
        cls_cfg, cls = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if family == "qwen3" else
                        (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
        cfg = cls_cfg(**common, tie_word_embeddings=family == "qwen2", eos_token_id=ids["<|im_end|>"],
                      bos_token_id=None)
        model = cls(cfg)
        tok_cfg = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        gen_eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(QWEN3_TEMPLATE)
    torch.manual_seed(seed)
    with torch.no_grad():  # larger than default weights: outputs far from uniform, so errors show
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        if cfg.tie_word_embeddings:
            model.tie_weights()
    model.eval().save_pretrained(path, safe_serialization=True)
    write_json(os.path.join(path, "tokenizer_config.json"), dict(tok_cfg, tokenizer_class="PreTrainedTokenizerFast"))
    write_json(os.path.join(path, "generation_config.json"), {"eos_token_id": gen_eos})
    return path


def hf_model(path: str):
    """The directory read back with transformers (the oracle)."""
    with open(os.path.join(path, "config.json")) as f:
        family = json.load(f)["model_type"]
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    return cls.from_pretrained(path, torch_dtype=torch.float32).eval()
