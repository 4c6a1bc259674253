"""Specification of Session.warm_up: one short request that runs the configured drafter and backend, so that a
combination that cannot serve fails when the node is configured, not at every request."""
from __future__ import annotations

import pytest

from runtime.serving.session import Session


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
