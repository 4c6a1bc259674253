"""A tiny bundle built by the real export path (HF save_pretrained -> build_bundle) from random
weights and a small BPE tokenizer with the zoo's special tokens. For tests that need a bundle but
not a trained model; tests that need meaningful predictions use the zoo."""
from __future__ import annotations

import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from export.bundle.builder import build_bundle
from runtime.text.prompts import SPECIAL_TOKENS

TEXT = ["navigate to the kitchen and pick up the red cup", "place the cup on the table", "open the drawer",
        "the robot inspects the shelf and waits", "hand the bottle to alice"] * 20


def make_tokenizer(path: str, vocab_size: int = 400) -> int:
    """A byte-level BPE tokenizer; vocab_size 400 is below the alphabet and special tokens (no merges: enough
    for the numpy and ONNX backends), 700 gives it merges, which llama.cpp needs to load a GGUF."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    tok.save(path)
    return tok.get_vocab_size()


# A random model has no trained window; this one's is wide enough for every context the tests ask of it (up to a
# 32768-position arena), since a session refuses max_context past max_position_embeddings
MAX_POSITIONS = 32768


def save_random_llama(path: str, vocab: int, layers: int, hidden: int, seed: int, tokenizer: str) -> None:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=hidden // 4, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    os.system(f"cp {tokenizer} {path}/tokenizer.json")


def make_tiny_bundle(root: str, tokenizer_vocab: int = 400) -> str:
    os.makedirs(root, exist_ok=True)
    tok = os.path.join(root, "tokenizer.json")
    vocab = make_tokenizer(tok, tokenizer_vocab)
    save_random_llama(os.path.join(root, "target"), vocab, 3, 64, 0, tok)
    save_random_llama(os.path.join(root, "draft"), vocab, 1, 32, 1, tok)
    return build_bundle(os.path.join(root, "target"), os.path.join(root, "bundle"), os.path.join(root, "draft"),
                        name="tiny")
