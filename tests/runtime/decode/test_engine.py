"""The decode loop: greedy speculative output is token-identical to plain decoding for every drafter
(chains and trees, full and partial acceptance), the KV cache ends in the same state, requests stop
for the right reason, and bad requests raise a RequestError naming the field."""
import time

import numpy as np
import pytest

from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.ngram import NgramDrafter, find_continuations, tree_from_branches
from runtime.decode.engine import Engine, StopCheck
from runtime.errors import RequestError
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams
from tests.support.hf_tiny import tiny_hf_model

GREEDY = SamplingParams()
PROMPTS = 50
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    _, spec, weights = tiny_hf_model("llama", seed=7, num_layers=2)
    return spec, weights


def perturbed(weights, scale, seed=0):
    """A draft that agrees with the target often but not always: its weights plus noise."""
    rng = np.random.default_rng(seed)
    return {k: v + scale * rng.standard_normal(v.shape).astype(np.float32) * np.abs(v).mean() for k, v in weights.items()}


def make_engine(spec, weights, drafter_kind="none", draft_weights=None, k=4, branching=1, positions=160):
    shapes = {"target": cache_shape(spec), "draft": cache_shape(spec)}
    arena = KVArena.for_context(shapes, positions)
    target = NumpyTarget(spec, weights, arena.allocate("target", shapes["target"], positions))
    drafter = None
    if drafter_kind == "ngram":
        drafter = NgramDrafter(num_tokens=k, branching=branching)
    elif drafter_kind == "draft_model":
        draft = NumpyTarget(spec, draft_weights, arena.allocate("draft", shapes["draft"], positions))
        drafter = DraftModelDrafter(draft, num_tokens=k, branching=branching)
    return Engine(target, drafter, eos_ids=())


def prompts(spec, n=PROMPTS):
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        base = list(rng.integers(0, spec.vocab_size, 6))
        out.append(base * 3 if i % 2 else base + list(rng.integers(0, spec.vocab_size, 4)))  # repetitive half
    return out


@pytest.fixture(scope="module")
def plain_outputs(model):
    spec, weights = model
    engine = make_engine(spec, weights)
    return [engine.generate(p, GREEDY, MAX_TOKENS).tokens for p in prompts(spec)]


DRAFTERS = [
    ("ngram", None, 4, 1),
    ("ngram", None, 3, 3),
    ("draft_model", 0.0, 4, 1),  # identical draft: everything accepted, bonus tokens
    ("draft_model", 0.3, 4, 1),  # partial acceptance
    ("draft_model", 0.3, 3, 2),  # a tree of 2 chains
]


@pytest.mark.parametrize("kind,noise,k,branching", DRAFTERS)
def test_greedy_speculative_output_is_token_identical_to_plain_decoding(model, plain_outputs, kind, noise, k, branching):
    spec, weights = model
    draft = perturbed(weights, noise) if noise is not None else None
    engine = make_engine(spec, weights, kind, draft, k, branching)
    accepted = 0
    for prompt, expected in zip(prompts(spec), plain_outputs):
        out = engine.generate(prompt, GREEDY, MAX_TOKENS)
        assert out.tokens == expected
        accepted += sum(out.stats.acceptance_by_depth[:1])
        assert out.stats.target_forwards == out.stats.cycles + 1
    assert accepted > 0, "the drafter never had a token accepted: the test would not exercise KV compaction"


def test_identical_draft_accepts_everything_and_tau_is_k_plus_one(model):
    spec, weights = model
    engine = make_engine(spec, weights, "draft_model", weights, k=4)
    out = engine.generate(prompts(spec)[0], GREEDY, 1 + 5 * 4)
    assert out.stats.tau == pytest.approx(5.0)
    assert out.stats.acceptance_by_depth == [1.0] * 4


def test_kv_cache_after_speculation_equals_plain_decoding(model):
    spec, weights = model
    plain = make_engine(spec, weights)
    spec_engine = make_engine(spec, weights, "draft_model", perturbed(weights, 0.3), k=3, branching=2)
    p = prompts(spec)[3]
    a = plain.generate(p, GREEDY, 20)
    b = spec_engine.generate(p, GREEDY, 20)
    assert a.tokens == b.tokens
    n = min(plain.target.cache_len, spec_engine.target.cache_len)
    np.testing.assert_allclose(spec_engine.target.cache.k[:n], plain.target.cache.k[:n], atol=1e-4)


def test_tokens_stream_through_the_callback_in_order(model):
    spec, weights = model
    engine = make_engine(spec, weights, "draft_model", weights, k=4)
    got = []
    out = engine.generate(prompts(spec)[1], GREEDY, 17, on_tokens=got.extend)
    assert got == out.tokens and len(got) == 17 and out.finish_reason == "max_tokens"


def test_eos_ends_the_request_and_is_not_emitted(model, plain_outputs):
    spec, weights = model
    expected = plain_outputs[0]
    eos = expected[5]
    engine = make_engine(spec, weights, "draft_model", weights)
    engine.eos = {eos}
    out = engine.generate(prompts(spec)[0], GREEDY, MAX_TOKENS)
    assert out.finish_reason == "eos" and out.tokens == expected[:expected.index(eos)]


def test_deadline_and_cancel_end_the_request_with_their_reason(model):
    spec, weights = model
    engine = make_engine(spec, weights, "ngram")
    out = engine.generate(prompts(spec)[0], GREEDY, 100, stop=StopCheck(deadline=time.monotonic() - 1))
    assert out.finish_reason == "deadline" and len(out.tokens) >= 1
    out = engine.generate(prompts(spec)[0], GREEDY, 100, stop=StopCheck(should_stop=lambda: "cancelled"))
    assert out.finish_reason == "cancelled"


@pytest.mark.parametrize("field,kwargs", [
    ("prompt", dict(prompt=[])),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=10_000)),
    ("temperature", dict(params=SamplingParams(temperature=float("nan")))),
    ("temperature", dict(params=SamplingParams(temperature=-1.0))),
    ("top_p", dict(params=SamplingParams(temperature=1.0, top_p=0.0))),
    ("top_p", dict(params=SamplingParams(temperature=1.0, top_p=1.5))),
    ("top_p", dict(params=SamplingParams(temperature=1.0, top_p=float("nan")))),
    ("top_p", dict(params=SamplingParams(top_p=-0.2))),  # greedy too: never read as "off"
    ("min_p", dict(params=SamplingParams(temperature=1.0, min_p=float("nan")))),
    ("prompt", dict(prompt=[1] * 100_000, max_tokens=0)),  # the prompt is at fault, whatever max_tokens says
    ("prompt", dict(prompt=[1] * 100_000)),
])
def test_bad_requests_raise_request_error_naming_the_field(model, field, kwargs):
    spec, weights = model
    engine = make_engine(spec, weights, "ngram")
    args = dict(prompt=[1, 2, 3], params=GREEDY, max_tokens=8)
    args.update(kwargs)
    with pytest.raises(RequestError) as err:
        engine.generate(args["prompt"], args["params"], args["max_tokens"])
    assert err.value.field == field


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    tokens = [5, 6, 7, 9, 5, 6, 8, 1, 5, 6]
    assert find_continuations(tokens, max_n=2, min_n=1, k=2, branches=1) == [[8, 1]]
    assert find_continuations(tokens, max_n=2, min_n=1, k=2, branches=2) == [[8, 1], [7, 9]]
    assert find_continuations([1, 2, 3], max_n=2, min_n=1, k=2, branches=1) == []
    tree = tree_from_branches([[8, 1], [8, 2]])
    assert tree.tokens.tolist() == [8, 1, 2] and tree.parents.tolist() == [-1, 0, 0]


class TickingClock:
    """A stand-in for the time module whose clock moves 1 s per reading: every span the engine measures is
    a whole number of seconds, so its time split can be checked for exact equality."""

    def __init__(self):
        self.now = 0.0
        self.readings = []  # every perf_counter value handed out

    def perf_counter(self) -> float:
        self.now += 1.0
        self.readings.append(self.now)
        return self.now

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("kind", ["none", "ngram", "draft_model"])
def test_the_time_split_has_no_overlapping_spans_and_the_wall_time_covers_the_request(model, monkeypatch, kind):
    import runtime.decode.engine as engine_module

    spec, weights = model
    engine = make_engine(spec, weights, kind, perturbed(weights, 0.3), k=3)
    clock = TickingClock()
    monkeypatch.setattr(engine_module, "time", clock)
    first_delivered = []  # the clock when the caller got its first tokens

    def on_tokens(batch):
        if not first_delivered:
            first_delivered.append(clock.now)

    s = engine.generate(prompts(spec)[1], GREEDY, MAX_TOKENS, on_tokens=on_tokens).stats
    # other_s is the wall time less the measured spans: > 0 only if prefill, draft and verify never overlap
    assert min(s.prefill_s, s.verify_s, s.other_s) > 0 and s.draft_s >= 0
    assert s.wall_s == clock.readings[-1] - clock.readings[0]  # from the request's first clock reading to its last
    assert s.ttft_s == first_delivered[0] - clock.readings[0]  # the first token reaches the caller at ttft
    assert (s.draft_s > 0) == (kind != "none")


def test_tau_counts_every_token_a_cycle_verified_even_those_after_eos(model, plain_outputs):
    """An identical draft (k=4) makes each cycle commit 5 tokens. With EOS in the middle of the first cycle's
    5, the output stops there, yet tau stays 5: it measures the drafter (tokens per target verify forward,
    the prefill's first token excluded), not the length of the answer."""
    spec, weights = model
    expected = plain_outputs[0]
    cut = next(i for i in range(2, 5) if expected[i] not in expected[:i])  # EOS inside cycle 1 (tokens 1..5)
    engine = make_engine(spec, weights, "draft_model", weights, k=4)
    engine.eos = {expected[cut]}
    out = engine.generate(prompts(spec)[0], GREEDY, MAX_TOKENS)
    assert out.finish_reason == "eos" and out.tokens == expected[:cut]
    assert out.stats.cycles == 1 and out.stats.tau == 5.0


def test_plain_greedy_cycles_verify_from_the_logits_argmax_without_building_distributions(model, plain_outputs,
                                                                                           monkeypatch):
    """Host work per cycle: greedy with nothing processing the logits (no allowed set, grammar or penalty) reads
    each row's argmax in place; no (T, V) float64 distribution is made. The tokens are plain decoding's."""
    import runtime.decode.engine as engine_module

    spec, weights = model
    built = []
    batch = engine_module.process_logits_batch
    monkeypatch.setattr(engine_module, "process_logits_batch", lambda *a, **k: (built.append(1), batch(*a, **k))[1])
    for kind, draft in (("none", None), ("draft_model", perturbed(weights, 0.3))):
        engine = make_engine(spec, weights, kind, draft, k=3, branching=2)
        for prompt, expected in list(zip(prompts(spec), plain_outputs))[:6]:
            assert engine.generate(prompt, GREEDY, MAX_TOKENS).tokens == expected
    assert built == []
    engine = make_engine(spec, weights)  # a repetition penalty processes the logits: the general path
    engine.generate(prompts(spec)[0], SamplingParams(repetition_penalty=1.3), 4)
    assert built


def test_a_nan_logit_in_a_plain_greedy_cycle_is_refused_not_decoded(model):
    spec, weights = model
    engine = make_engine(spec, weights)
    forward = engine.target.forward

    def broken(tokens, *a, **k):
        res = forward(tokens, *a, **k)
        if len(tokens) == 1:  # the cycles' forwards, not the prefill's
            res.logits[0, 3] = np.nan
        return res

    engine.target.forward = broken
    with pytest.raises(ValueError, match="NaN"):
        engine.generate(prompts(spec)[0], GREEDY, 4)
