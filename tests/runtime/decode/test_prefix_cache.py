"""The prompt prefix cache (Engine.prefix_cache, `memory.prefix_cache`): a request keeps the target's K/V rows
of the prefix its prompt shares with the previous request and prefills only the rest. It must change nothing
but the time: the same requests in the same order give the same tokens with the cache and without it, for
every drafter (the draft model carries its own cache over; MTP rebuilds from the kept taps)."""
from tests.support import REPO_ROOT
import os

import pytest

from runtime.text.prompts import planner_prompt
from runtime.serving.session import GenerationParams, Session

ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")
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


@pytest.fixture(scope="module")
def mtp2_bundle(tmp_path_factory):
    """A tiny random target with two DeepSeek-V3 MTP modules, each with its own cache rows."""
    from export.bundle.builder import build_bundle
    from tests.support.mtp_tiny import write_mtp_checkpoint
    root = str(tmp_path_factory.mktemp("mtp2"))
    return build_bundle(write_mtp_checkpoint(root, modules=2), os.path.join(root, "bundle"), name="mtp2")


@pytest.mark.parametrize("num_tokens", [1, 2, 4])  # module 1 idle / each module once / module 1 reused
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefix_cache_with_two_mtp_modules_gives_the_same_tokens_and_drafts_as_a_full_prefill(mtp2_bundle, num_tokens,
                                                                                               temperature):
    # each module keeps the rows its inputs and tokens still justify (MTPDrafter.keep_plan); what it cannot
    # keep, it and the modules before it (or the target) recompute
    params = GenerationParams(max_tokens=20, temperature=temperature, seed=7)
    runs = {cache: _run(Session.open(mtp2_bundle, drafter="mtp", backend="numpy_ref", num_tokens=num_tokens,
                                     max_context=512, prefix_cache=cache), params) for cache in (False, True)}
    assert runs[True][0] == runs[False][0]
    assert [st.tau for st in runs[True][1]] == pytest.approx([st.tau for st in runs[False][1]])
    reused = [st.prefix_tokens for st in runs[True][1]]
    # request 2 shares 2 tokens with request 1: module 1's row t holds x_{t+2}, so two modules keep nothing there
    assert reused[1] > 0 and all(r > 0 for r in reused[3:6]), reused


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


@pytest.mark.parametrize("cache", [False, True])
def test_a_request_whose_last_cycle_verifies_no_tree_leaves_the_draft_model_usable(tiny_bundle, cache):
    # max_tokens=2: the prefill gives one token and the one cycle left verifies no tree (nothing to draft),
    # after a request that did draft: the drafter must not act on the earlier request's proposal
    s = Session.open(tiny_bundle, drafter="draft_model", max_context=512, prefix_cache=cache)
    plain = Session.open(tiny_bundle, drafter="none", max_context=512, prefix_cache=cache)
    prompts, unrelated = _requests(s)
    for ids, n in ((prompts[0], 12), (unrelated, 2), (prompts[1], 12), (prompts[1], 2), (prompts[2], 12)):
        assert s.generate_ids(ids, GenerationParams(max_tokens=n))[1] == plain.generate_ids(ids, GenerationParams(max_tokens=n))[1]


@pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")), reason="no zoo bundle: run `make bundles`")
def test_mtp_keeps_its_pending_target_states_over_a_cycle_without_a_tree():
    # a request ending on a one-token cycle (no tree) leaves target states the module has not run yet; the next
    # request, extending that one, must reuse every target row and draft exactly what a full prefill drafts
    def follow_up(cache):
        s = Session.open(ZOO, drafter="mtp", backend="numpy_ref", prefix_cache=cache)
        first = s.tokenizer.encode(planner_prompt("open the drawer", CONTEXT))
        out = s.generate_ids(first, GenerationParams(max_tokens=2))[1]
        ids = first + out + s.tokenizer.encode("<|ctx|>the drawer is stuck")
        return len(first) + len(out) - 1, s.generate_ids(ids, GenerationParams(max_tokens=24))  # last token: not run
    rows, cached = follow_up(True)
    _, full = follow_up(False)
    assert cached[3].prefix_tokens == rows  # the prompt and the short request's first token: the whole cache
    assert cached[1] == full[1] and cached[3].tau == pytest.approx(full[3].tau)


def test_a_first_token_the_grammar_or_vocabulary_rules_out_is_a_request_error(tiny_bundle):
    from runtime.errors import RequestError
    from runtime.sampling import SamplingParams
    s = Session.open(tiny_bundle, drafter="none", max_context=512)
    ids = s.tokenizer.encode("navigate to the kitchen")
    digits_only = s.grammar(json_schema={"type": "integer"})
    letter = s.tokenizer.encode("a")[0]
    for first, grammar in ((letter, digits_only), (10 ** 6, None)):
        with pytest.raises(RequestError, match="first_token"):
            s.engine.generate(ids, SamplingParams(), 4, first_token=first, grammar=grammar)
