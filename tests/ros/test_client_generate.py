"""EdgespecClient.generate's wait for the feedback tail, with stand-ins for the ROS calls (no node)."""
from __future__ import annotations

from types import SimpleNamespace

from edgespec_interfaces.action import Generate

from edgespec_ros.client import EdgespecClient, feedback_complete


class _Stub:
    """The parts of EdgespecClient that generate() calls; the node's feedback arrives as `deliver` says."""

    def __init__(self, deliver_before_result, deliver_after_result=()):
        self.before, self.after = list(deliver_before_result), list(deliver_after_result)
        self.spins = 0
        self._on_feedback = None

    def send_goal(self, on_feedback, **_fields):
        self._on_feedback = on_feedback
        return SimpleNamespace(accepted=True)

    def result(self, _handle, _timeout_s):
        for msg in self.before:
            self._on_feedback(msg)
        return 4, Generate.Result(text="abc", token_ids=[1, 2, 3], finish_reason="eos", success=True)

    def spin_once(self):
        self.spins += 1
        if self.after:
            self._on_feedback(self.after.pop(0))


def _fb(tokens: int, seq: int) -> Generate.Feedback:
    return Generate.Feedback(text_delta="x", tokens=tokens, seq=seq)


def test_generate_returns_without_spinning_when_the_feedback_already_covers_the_result():
    stub = _Stub([_fb(2, 0), _fb(3, 1)])
    accepted, status, result, feedback = EdgespecClient.generate(stub, prompt="go")
    assert accepted and status == 4 and [f.seq for f in feedback] == [0, 1]
    assert stub.spins == 0, "a fixed wait after the result was most of a short goal's round trip"


def test_generate_waits_for_a_feedback_message_that_lands_after_the_result():
    stub = _Stub([_fb(2, 0)], deliver_after_result=[_fb(3, 1)])
    _, _, _, feedback = EdgespecClient.generate(stub, prompt="go")
    assert [f.tokens for f in feedback] == [2, 3] and stub.spins == 1


def test_feedback_is_complete_when_its_last_count_reaches_the_results_tokens():
    result = Generate.Result(token_ids=[1, 2, 3])
    assert not feedback_complete([], result) and not feedback_complete([_fb(2, 0)], result)
    assert feedback_complete([_fb(3, 1)], result)
    assert feedback_complete([], Generate.Result(token_ids=[]))  # nothing generated: nothing to wait for
