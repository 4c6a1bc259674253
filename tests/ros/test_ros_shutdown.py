"""SIGINT / SIGTERM with requests queued and a generation running: the node stops accepting, answers
every queued request (success=false, the reason), aborts the goals with their partial text and exits 0
without a traceback."""
from __future__ import annotations

import signal

import pytest

from tests.ros.conftest import connect, spin_all, start_node, wait_for_diagnostics

LONG = 8000  # tokens: many seconds on the tiny bundle; the signal comes long before the end
PLANS, QUEUED_GOALS = 8, 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_answers_every_queued_request_aborts_goals_with_partial_text_and_exits_0(
        tiny_bundle, client_node, tmp_path, signum):
    import rclpy
    from edgespec_interfaces.srv import Plan

    ns = f"/shutdown_{signum.name.lower()}"
    path = f"{ns}/edgespec"
    node = start_node(str(tmp_path), ns, {"bundle": tiny_bundle, "autostart": True, "queue_limit": 16,
                                          "max_context": 8192, "diagnostics_period_s": 0.1})
    try:
        client = connect(client_node, node, path)
        feedback = []
        running = client.send_goal(feedback.append, prompt="navigate to the kitchen", max_tokens=LONG)
        assert running.accepted
        while not feedback:
            rclpy.spin_once(client_node, timeout_sec=0.05)
        queued_goals = [client.send_goal(prompt=f"open drawer {i}", max_tokens=LONG) for i in range(QUEUED_GOALS)]
        assert all(g.accepted for g in queued_goals)
        plans = [client.plan_client.call_async(Plan.Request(instruction=f"bring cup {i}", max_tokens=LONG))
                 for i in range(PLANS)]
        wait_for_diagnostics(client_node, path,
                             lambda _s, v: int(v["queue_length"]) == 1 + QUEUED_GOALS + PLANS)
        results = [g.get_result_async() for g in [running, *queued_goals]]

        node.proc.send_signal(signum)
        spin_all(client_node, plans + results, timeout_s=60)
        rc = node.proc.wait(timeout=60)
    finally:
        node.stop()
    log = node.log()
    assert rc == 0, log
    for bad in ("Traceback", "InvalidHandle", "RCLError"):
        assert bad not in log, log

    for answer in (f.result() for f in plans):
        assert not answer.success and answer.error_field == "state"
        assert "shutting down" in answer.message and signum.name in answer.message, answer.message
    statuses = [f.result().status for f in results]
    assert statuses == [6] * (1 + QUEUED_GOALS)  # ABORTED
    first, *rest = [f.result().result for f in results]
    assert not first.success and first.finish_reason == "cancelled" and "shutting down" in first.message
    assert first.text and first.token_ids, "the running goal keeps the text it had"
    assert first.text.startswith("".join(f.text_delta for f in feedback))
    for r in rest:
        assert not r.success and r.error_field == "state" and "shutting down" in r.message
