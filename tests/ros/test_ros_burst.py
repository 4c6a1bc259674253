"""A burst of simultaneous requests, far beyond the queue: every request gets an answer (served, or
refused with error_field "queue", or a goal rejected), none is lost in the middleware."""
from __future__ import annotations

import pytest

from tests.ros.conftest import connect, spin_all, start_node

NS = "/burst"
PATH = f"{NS}/edgespec"
QUEUE_LIMIT = 16
PLANS, ACTIONS, GOALS = 24, 24, 16  # 64 clients, 4x the queue limit


@pytest.fixture(scope="module")
def burst_node(tiny_bundle, client_node, tmp_path_factory):
    node = start_node(str(tmp_path_factory.mktemp("burst")), NS,
                      {"bundle": tiny_bundle, "drafter": "draft_model", "autostart": True,
                       "queue_limit": QUEUE_LIMIT, "max_context": 1024})
    client = connect(client_node, node, PATH)
    yield client, node
    rc = node.stop()
    assert rc == 0, f"node exited with {rc}; log:\n{node.log()}"


def test_64_simultaneous_clients_are_each_answered_or_refused_and_none_is_lost(burst_node, client_node):
    from edgespec_interfaces.action import Generate
    from edgespec_interfaces.srv import ActionTokens, Plan
    from edgespec_ros.qos import REQUEST_QOS, action_qos_kwargs
    from rclpy.action import ActionClient

    _client, node = burst_node
    # Clients keep all responses too (edgespec_ros.qos says why); the node's side is what this tests.
    plans = [client_node.create_client(Plan, f"{PATH}/plan", qos_profile=REQUEST_QOS) for _ in range(PLANS)]
    acts = [client_node.create_client(ActionTokens, f"{PATH}/action_tokens", qos_profile=REQUEST_QOS)
            for _ in range(ACTIONS)]
    goals = [ActionClient(client_node, Generate, f"{PATH}/generate", **action_qos_kwargs()) for _ in range(GOALS)]
    for c in plans + acts:
        assert c.wait_for_service(timeout_sec=30)
    for g in goals:
        assert g.wait_for_server(timeout_sec=30)

    # All 64 go out before this process spins once: they reach the node at the same instant.
    plan_f = [c.call_async(Plan.Request(instruction=f"bring cup {i}", max_tokens=6)) for i, c in enumerate(plans)]
    act_f = [c.call_async(ActionTokens.Request(instruction=f"pick cup {i}", observation=[0.1] * 8, num_actions=1))
             for i, c in enumerate(acts)]
    goal_f = [g.send_goal_async(Generate.Goal(prompt=f"navigate to room {i}", max_tokens=6))
              for i, g in enumerate(goals)]
    # A lost request never completes; the bound only turns "lost" into a failure instead of a hang.
    spin_all(client_node, plan_f + act_f + goal_f, timeout_s=60)
    handles = [f.result() for f in goal_f]
    result_f = [h.get_result_async() for h in handles if h.accepted]
    spin_all(client_node, result_f, timeout_s=60)

    answers = [f.result() for f in plan_f + act_f] + [f.result().result for f in result_f]
    served = [a for a in answers if a.success]
    refused = [a for a in answers if not a.success]
    rejected_goals = sum(not h.accepted for h in handles)
    assert all(a.error_field == "queue" and "queue_limit=16" in a.message for a in refused), \
        [(a.error_field, a.message) for a in refused if a.error_field != "queue"]
    assert len(served) + len(refused) + rejected_goals == PLANS + ACTIONS + GOALS
    assert len(served) >= QUEUE_LIMIT, "at least a queue's worth is served"
    assert refused or rejected_goals, "64 at once must overflow a queue of 16"
    print(f"\nburst of {PLANS + ACTIONS + GOALS}: {len(served)} served, {len(refused)} refused (queue), "
          f"{rejected_goals} goals rejected, 0 lost")
    assert node.alive()
    for c in plans + acts:
        client_node.destroy_client(c)
    for g in goals:
        g.destroy()
