"""Tiny random HF checkpoints of one's own model, Qwen3- and Llama-3-style, with chat templates written here in the
style of the real ones (system / user / assistant roles, generation prompt; Qwen3's in chat_template.jinja,
Llama-3's in tokenizer_config.json), special tokens, and EOS lists in generation_config.json."""
from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.text.prompts import CHAT_PLANNER
from tests.support.tiny_bundle import TEXT

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'user' or message.role == 'assistant') %}
        {{- raise_exception('Only user and assistant roles follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>"]


def save_tokenizer(path: str, special) -> int:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT + [CHAT_PLANNER.system], trainer)
    tok.save(path)
    return tok.get_vocab_size()


def write_json(path: str, d) -> None:
    with open(path, "w") as f:
        json.dump(d, f)


def save_checkpoint(root: str, family: str) -> str:
    """A tiny random HF directory of `family` (qwen3 | llama3) with its tokenizer files and chat template."""
    path = os.path.join(root, family)
    os.makedirs(path)
    special = QWEN3_SPECIAL if family == "qwen3" else LLAMA3_SPECIAL
    vocab = save_tokenizer(os.path.join(path, "tokenizer.json"), special)
    ids = {t: i for i, t in enumerate(special)}  # the trainer gives the special tokens the first ids, in order
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**common, tie_word_embeddings=True, eos_token_id=ids["<|im_end|>"],
                                       bos_token_id=None)
        model = transformers.Qwen3ForCausalLM(cfg)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>"}
        gen_eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:  # where transformers saves it now
            f.write(QWEN3_TEMPLATE)
    else:
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, bos_token_id=ids["<|begin_of_text|>"],
                                       eos_token_id=ids["<|end_of_text|>"])
        model = transformers.LlamaForCausalLM(cfg)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False,
                                 "rstrip": False, "single_word": False, "special": True}, "chat_template": LLAMA3_TEMPLATE}
        gen_eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    torch.manual_seed(0)
    with torch.no_grad():  # larger than default weights: varied greedy output instead of one repeated token
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    model.eval().save_pretrained(path, safe_serialization=True)
    write_json(os.path.join(path, "tokenizer_config.json"), tok_cfg)
    write_json(os.path.join(path, "generation_config.json"), {"eos_token_id": gen_eos})
    return path
