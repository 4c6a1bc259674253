"""A session's compiled grammars: a request's constraint (JSON Schema or Lark) or the action-token run, compiled
against the session's tokenizer once and kept for the next requests (a robot sends the same schema again and
again), the most recent few."""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

from runtime.errors import RequestError
from runtime.text.grammar import Grammar, GrammarTokenizer
from runtime.text.recent import Recent

KEPT = 8  # compiled grammars kept, the most recently used


class GrammarCache:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos: Sequence[int]):
        self._tokenizer_args = (tokenizer_path, vocab_size, eos)
        self._tokenizer: Optional[GrammarTokenizer] = None  # built on the first grammar: most sessions need none
        self._compiled: Recent[Grammar] = Recent(KEPT)  # by (kind, text)

    def tokenizer(self) -> GrammarTokenizer:
        if self._tokenizer is None:
            self._tokenizer = GrammarTokenizer(*self._tokenizer_args)
        return self._tokenizer

    def compiled(self, key: tuple, compile_: Callable[[], Grammar]) -> Grammar:
        """The grammar compiled for `key`, from the last few requests' if there."""
        return self._compiled.get_or_make(key, compile_)

    def constraint(self, json_schema=None, grammar: Optional[str] = None, field: Optional[str] = None) -> Optional[Grammar]:
        """A request's constraint: a JSON Schema (dict or text) or a Lark grammar; None if neither."""
        if json_schema is not None and grammar is not None:
            raise RequestError(field or "grammar", "send either a JSON Schema or a Lark grammar, not both")
        if json_schema is None and grammar is None:
            return None
        if grammar is not None:
            return self.compiled(("lark", grammar), lambda: Grammar.from_lark(grammar, self.tokenizer(), field or "grammar"))
        key = ("json", json_schema if isinstance(json_schema, str) else json.dumps(json_schema, sort_keys=True))
        return self.compiled(key, lambda: Grammar.from_json_schema(json_schema, self.tokenizer(), field or "json_schema"))

    def token_run(self, allowed: Sequence[int], n: int, field: str) -> Grammar:
        """Exactly `n` tokens of `allowed`, then EOS (an action chunk)."""
        return self.compiled(("actions", n), lambda: Grammar.token_run(allowed, n, self.tokenizer(), field))
