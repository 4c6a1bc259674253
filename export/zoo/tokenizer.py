"""The zoo's byte-level BPE tokenizer (`tokenizers` library): task specials first (PAD=0, BOS=1, EOS=2, ...),
then the 256 action-bin tokens `<|a000|>`..`<|a255|>`, then the 256 byte symbols and the learned merges.

Words, punctuation runs and whitespace runs are pre-split apart (a space is never glued to the word after it), so a
word is the same token sequence wherever it stands: "kitchen" in the instruction `... the kitchen<|sep|>` and in the
plan `"room":"kitchen"` are both the token `kitchen`, and the planner learns to copy rather than to translate
`Ġkitchen` -> `kitchen`.
The runtime loads the saved tokenizer.json with `tokenizers.Tokenizer.from_file` (no torch)."""
from __future__ import annotations

import re
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.text.prompts import SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes -> symbols only; no re-split
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):  # the prompts and ActionTokenizer rely on these fixed ids
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def strip_specials(text: str) -> str:
    """Training text with the special markers removed (BPE merges are learned on the plain parts only)."""
    return re.sub(r"<\|[a-z0-9]+\|>", "\n", text)
