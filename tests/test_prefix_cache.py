"""The prompt prefix cache (Engine.prefix_cache, `memory.prefix_cache`): a request keeps the target's K/V rows
of the prefix its prompt shares with the previous request and prefills only the rest. It must change nothing
but the time: the same requests in the same order give the same tokens with the cache and without it, for
every drafter (the draft model carries its own cache over; MTP rebuilds from the kept taps)."""
import os

import pytest

from runtime.prompts import planner_prompt
from runtime.session import GenerationParams, Session

ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "bundles", "zoo")
INSTRUCTIONS = ["bring the red cup to the kitchen", "bring the red cup to the garage", "open the drawer",
                "open the drawer"]
CONTEXT = "the robot stands in the hall; the red cup is on the shelf"


def _requests(session):
    """Planner prompts sharing the template and the standing context, a repeat, a prompt that extends the last
    prompt + answer (a follow-up turn), a strict prefix of the previous prompt and an unrelated prompt."""
    enc = session.tokenizer.encode
    prompts = [enc(planner_prompt(i, CONTEXT)) for i in INSTRUCTIONS]
    return prompts, enc("<|bos|><|text|>the robot waits by the door")


def _run(session, params):
    prompts, unrelated = _requests(session)
    outs, stats = [], []
    for ids in prompts:
        _, tokens, _, s = session.generate_ids(ids, params)
        outs.append(tokens)
        stats.append(s)
    follow_up = prompts[-1] + outs[-1] + session.tokenizer.encode("<|ctx|>the cup was not there")
    for ids in (follow_up, follow_up[:len(follow_up) - 3], unrelated):
        _, tokens, _, s = session.generate_ids(ids, params)
        outs.append(tokens)
        stats.append(s)
    return outs, stats


@pytest.mark.parametrize("drafter,branching", [("none", 1), ("ngram", 1), ("draft_model", 1), ("draft_model", 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefix_cache_gives_the_same_tokens_as_a_full_prefill(tiny_bundle, drafter, branching, temperature):
    params = GenerationParams(max_tokens=20, temperature=temperature, seed=7)
    runs = {}
    for cache in (False, True):
        s = Session.open(tiny_bundle, drafter=drafter, max_context=512, prefix_cache=cache)
        s.engine.drafter and setattr(s.engine.drafter, "branching", branching)
        runs[cache] = _run(s, params)
    (plain_out, plain_stats), (cached_out, cached_stats) = runs[False], runs[True]
    assert cached_out == plain_out
    assert all(st.prefix_tokens == 0 and st.prefix_hits == 0 for st in plain_stats)
    assert plain_stats[-1].prefix_misses == len(plain_stats)
    reused = [st.prefix_tokens for st in cached_stats]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:-1]) and reused[-1] <= 2  # unrelated: <|bos|> at most
    assert reused[3] == cached_stats[3].prefix_tokens + cached_stats[3].prefill_tokens - 1  # repeat: all but one
    assert cached_stats[-2].prefill_tokens == 1  # a strict prefix of the previous prompt: only its last token runs
    assert cached_stats[-1].prefix_hits + cached_stats[-1].prefix_misses == len(cached_stats)


@pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")), reason="no zoo bundle: run `make bundles`")
@pytest.mark.parametrize("backend", ["onnx", "numpy_ref"])
def test_prefix_cache_with_mtp_rebuilds_the_module_rows_exactly(backend):
    params = GenerationParams(max_tokens=24)
    runs = {cache: _run(Session.open(ZOO, drafter="mtp", backend=backend, prefix_cache=cache), params)
            for cache in (False, True)}
    assert runs[True][0] == runs[False][0]
    assert sum(st.prefix_tokens for st in runs[True][1]) > 0
    # tau is the drafter's: the module's rebuilt rows propose what full ones would
    assert [st.tau for st in runs[True][1]] == pytest.approx([st.tau for st in runs[False][1]])


def test_a_request_that_fails_midway_leaves_the_next_one_a_full_prefill(tiny_bundle, monkeypatch):
    s = Session.open(tiny_bundle, drafter="draft_model", max_context=512)
    prompts, _ = _requests(s)
    params = GenerationParams(max_tokens=16)
    _, first, _, _ = s.generate_ids(prompts[0], params)
    forward, calls = s.engine.target.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("backend failed")
        return forward(*args, **kwargs)

    monkeypatch.setattr(s.engine.target, "forward", failing)
    with pytest.raises(RuntimeError):
        s.generate_ids(prompts[1], params)
    monkeypatch.setattr(s.engine.target, "forward", forward)
    _, again, _, st = s.generate_ids(prompts[0], params)
    assert st.prefix_tokens == 0 and again == first
