"""Specification of Session.warm_up: one short request that runs the configured drafter and backend, so that a
combination that cannot serve fails when the node is configured, not at every request."""
from __future__ import annotations

import pytest

from runtime.serving.session import GenerationParams, Session


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_the_warm_up_makes_the_drafter_propose_even_if_the_model_would_stop_at_once(tiny_bundle, drafter):
    s = Session.open(tiny_bundle, drafter=drafter)
    calls = []
    propose = s.drafter.propose
    s.drafter.propose = lambda ctx: (calls.append(ctx.max_nodes), propose(ctx))[1]
    s.engine.eos = set(range(s.bundle.target.spec.vocab_size))  # every token ends an answer ...
    s.engine.eos.discard(0)
    try:
        stats = s.warm_up()
    finally:
        s.close()
    assert calls and calls[0] >= 1, "the drafter never proposed"  # ... yet a draft was made and verified
    assert stats.cycles >= 1 and stats.drafter == drafter


def test_a_drafter_that_cannot_run_on_this_backend_fails_the_warm_up(tiny_bundle):
    s = Session.open(tiny_bundle, drafter="draft_model")

    def broken(_ctx):  # what ONNX Runtime raised for an fp16 graph given float32 (issue 29)
        raise ValueError("Unexpected input data type. Actual: (tensor(float16)), expected: (tensor(float))")

    s.drafter.propose = broken
    try:
        with pytest.raises(ValueError, match="tensor"):
            s.warm_up()
    finally:
        s.close()


def test_the_adaptive_rule_learns_nothing_from_the_warm_up(tiny_bundle):
    """A warm-up pays first-run allocations; were its cycles timed into the adaptive rule, a drafter's first drafting
    cycle (several times a later one's cost) would scale drafting up as too dear. Control: a request does teach it."""
    s = Session.open(tiny_bundle, drafter="draft_model", shape="adaptive")
    try:
        s.warm_up("<|bos|>hello")  # a real prompt first (as the bench warms up), then a cycle sure to draft
        after_warm_up = (dict(s.engine.policy.trackers), list(s.engine.policy._scale), dict(s.engine.policy.realized))
        s.generate("<|bos|>hello", GenerationParams(max_tokens=8))
        after_request = (dict(s.engine.policy.trackers), list(s.engine.policy._scale))
    finally:
        s.close()
    assert after_warm_up == ({}, [1.0, 1.0], {})
    assert after_request[0], "control: a request must leave acceptance in the rule for this test to mean anything"
