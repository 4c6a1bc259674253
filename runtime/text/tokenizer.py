"""The bundle's tokenizer (an HF `tokenizer.json`, read with the `tokenizers` library — no torch)."""
from __future__ import annotations

from typing import List, Optional, Sequence

from runtime.errors import BundleError


class Tokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - a packaging error on the robot image
            raise BundleError("the `tokenizers` package is missing; `pip install tokenizers`") from exc
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as exc:
            raise BundleError(f"{path}: cannot load tokenizer ({exc}); re-export the bundle") from exc
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(int(token_id))


class StreamDecoder:
    """Turns a growing list of token ids into text deltas. Byte-level BPE can split a character over
    several tokens, so a delta is only released once it no longer ends in a partial character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: List[int] = []
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta

    def flush(self) -> str:
        """The rest of the text at the end of a request, partial characters included."""
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return delta
