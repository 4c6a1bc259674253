"""A session's grammar cache (runtime/serving/grammars.py): a constraint sent again is not compiled again, the
least recently used goes first once KEPT are held, and a request naming two constraints is refused by its field."""
import pytest

from runtime.errors import RequestError
from runtime.serving.grammars import KEPT, GrammarCache


def _cache():
    return GrammarCache("no-tokenizer.json", 10, [0])  # the tokenizer is only read by a real compile


def test_a_key_seen_before_is_served_without_compiling_and_the_least_recently_used_goes_first():
    cache, compiled = _cache(), []

    def get(key):
        return cache.compiled(key, lambda: compiled.append(key) or f"grammar {key}")

    for key in range(KEPT):
        get(key)
    assert get(0) == "grammar 0" and compiled == list(range(KEPT))  # a hit: 0 is now the most recent
    get(KEPT)  # one too many: 1, the least recently used, is dropped
    get(0)
    get(1)
    assert compiled == list(range(KEPT)) + [KEPT, 1]


def test_no_constraint_is_none_and_two_are_refused_naming_the_field():
    cache = _cache()
    assert cache.constraint() is None
    with pytest.raises(RequestError, match="schema.*either a JSON Schema or a Lark grammar, not both"):
        cache.constraint({"type": "integer"}, "start: /a/", field="schema")
