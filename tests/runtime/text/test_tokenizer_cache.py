"""runtime/text/tokenizer.py keeps the ids of recent short request texts and of the template's pieces: a
repeated request tokenizes exactly as the first time (and as a fresh tokenizer), long texts are not kept,
and a caller changing the ids it got cannot change the next answer."""
from __future__ import annotations

from runtime.text.prompts import ZOO_PROMPTS, action_request, planner_request
from runtime.text.tokenizer import TEXT_CACHE_CHARS, Tokenizer


def test_repeated_requests_tokenize_as_a_fresh_tokenizer_does(tiny_bundle):
    path = f"{tiny_bundle}/tokenizer.json"
    tok = Tokenizer(path)
    prompts = [planner_request("bring the cup<|sep|>", "ctx <|eos|>", ZOO_PROMPTS),
               action_request("lift it", "cup ahead", ZOO_PROMPTS), planner_request("bring the cup", "", ZOO_PROMPTS)]
    first = [tok.encode_prompt(p) for p in prompts]
    again = [tok.encode_prompt(p) for p in prompts]
    assert first == again == [Tokenizer(path).encode_prompt(p) for p in prompts]
    first[0].append(999)  # the caller's list is its own
    assert tok.encode_prompt(prompts[0]) == again[0]


def test_only_short_texts_are_kept(tiny_bundle):
    tok = Tokenizer(f"{tiny_bundle}/tokenizer.json")
    long_text = "go " * (TEXT_CACHE_CHARS // 3 + 10)
    tok.encode_prompt(planner_request(long_text, "", ZOO_PROMPTS))
    tok.encode_prompt(planner_request("short one", "", ZOO_PROMPTS))
    assert tok._text_cache.get(long_text.strip()) is None and tok._text_cache.get("short one") is not None
