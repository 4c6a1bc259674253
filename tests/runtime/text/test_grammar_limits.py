"""Specification: a schema beyond what the grammar engine (llguidance) or the JSON reader handles is refused
when it is compiled, with error_field schema, never as an internal error at the first token."""
from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.errors import RequestError
from runtime.text import grammar as grammar_mod
from runtime.text.grammar import MAX_SCHEMA_DEPTH, Grammar, GrammarTokenizer, json_depth

WIDE = {"anyOf": [{"type": "object", "properties": {"skill": {"const": f"s{i}"}}, "required": ["skill"]}
                  for i in range(2500)]}  # llguidance: "Current row has 2500 items; max is 2000"


@pytest.fixture(scope="module")
def tok(tiny_bundle):
    from runtime.model import bundle as bundle_io
    b = bundle_io.load(tiny_bundle)
    return GrammarTokenizer(b.path(b.tokenizer), b.target.spec.vocab_size, b.target.spec.eos_token_ids or [2])


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth('{"a": [1, {"b": "[["}]}') == 3
    assert json_depth('"{{{"') == 0 and json_depth('{"a\\"{": 1}') == 1


def test_the_boolean_schema_true_allows_any_json_and_false_is_refused(tok):
    g = Grammar.from_json_schema("true", tok, "schema")
    assert g.start().allowed(()).any()
    assert Grammar.from_json_schema(True, tok, "schema").start().allowed(()).any()
    with pytest.raises(RequestError, match="`false`") as exc:
        Grammar.from_json_schema("false", tok, "schema")
    assert exc.value.field == "schema"


@pytest.mark.parametrize("depth", [MAX_SCHEMA_DEPTH + 1, 10_000])
def test_a_schema_nested_too_deep_is_refused_naming_the_field(tok, depth):
    text = '{"type":"array","items":' * depth + "{}" + "}" * depth
    with pytest.raises(RequestError, match=f"at most {MAX_SCHEMA_DEPTH} levels") as exc:
        Grammar.from_json_schema(text, tok, "schema")
    assert exc.value.field == "schema"


def test_an_anyof_beyond_the_parsers_limit_is_refused_at_compile_time(tok):
    for schema in (WIDE, json.dumps(WIDE)):
        with pytest.raises(RequestError, match="max is 2000") as exc:
            Grammar.from_json_schema(schema, tok, "schema")
        assert exc.value.field == "schema"


def test_a_limit_met_while_decoding_is_a_request_error_of_the_field_not_an_internal_error(tok, monkeypatch):
    monkeypatch.setattr(grammar_mod, "PROBE_TOKENS", 0)  # as if the compile-time walk had not met it
    g = Grammar.from_json_schema(WIDE, tok, "schema")
    state = g.start()
    first = int(np.flatnonzero(state.allowed(()))[0])
    with pytest.raises(RequestError, match="max is 2000") as exc:
        state.commit([first])
    assert exc.value.field == "schema"


def test_a_plan_with_a_too_wide_schema_is_refused_before_it_runs(tiny_bundle):
    from runtime.serving.session import GenerationParams, Session
    s = Session.open(tiny_bundle, drafter="none")
    try:
        with pytest.raises(RequestError) as exc:
            s.plan("bring the cup", params=GenerationParams(max_tokens=4), schema=json.dumps(WIDE))
        assert exc.value.field == "schema"
    finally:
        s.close()
