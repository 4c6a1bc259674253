"""The active node as a robot's planner sees it: services, the streamed action, queueing, bad input,
diagnostics and parameters. One node process (tiny bundle, real runtime) serves the whole module."""
from __future__ import annotations

import math
import os
import time

import pytest

from runtime.errors import RequestError
from runtime.text.prompts import parse_plan
from tests.ros.conftest import ROOT, connect, spin_all, start_node, wait_for_diagnostics

NS = "/serve"
PATH = f"{NS}/edgespec"
LONG = 8000  # tokens: a generation of many seconds on the tiny bundle; the tests cancel it or cut it short
PARAMS = {"bundle": None, "drafter": "draft_model", "autostart": True, "queue_limit": 16, "max_context": 8192,
          "default_max_tokens": 24, "diagnostics_period_s": 1.0, "feedback_period_s": 0.03}


@pytest.fixture(scope="module")
def served(tiny_bundle, client_node, tmp_path_factory):
    node = start_node(str(tmp_path_factory.mktemp("serve")), NS, {**PARAMS, "bundle": tiny_bundle})
    client = connect(client_node, node, PATH)
    yield client, node
    rc = node.stop()
    assert rc == 0, f"node exited with {rc}; log:\n{node.log()}"


def test_plan_service_answers_with_text_parse_verdict_and_speculative_stats(served):
    client, _ = served
    resp = client.plan(instruction="bring the red cup to the table", context="cup on shelf", max_tokens=16)
    assert resp.success, resp.message
    assert resp.finish_reason in ("eos", "max_tokens")
    try:  # random weights: whatever the text, the verdict is the runtime parser's on exactly that text
        parse_plan(resp.text)
        verdict = (True, "")
    except RequestError as exc:
        verdict = (False, str(exc))
    assert (resp.plan_ok, resp.plan_error) == verdict
    s = resp.stats
    assert 1 <= s.tokens <= 16 and s.target_forwards >= 1 and s.tau >= 1.0
    assert s.drafter == "draft_model" and s.backend and s.memory_bytes > 0 and s.tokens_per_s > 0
    # The time split adds up to the wall time (float32 fields), and tau is per verify forward (cycles).
    assert s.prefill_s + s.draft_s + s.verify_s + s.other_s == pytest.approx(s.wall_s, rel=1e-5)
    assert s.tokens_per_s == pytest.approx(s.tokens / s.wall_s, rel=1e-5) and s.ttft_s == s.prefill_s
    assert s.target_forwards == s.cycles + 1 and s.tokens <= 1 + round(s.tau * s.cycles)


def test_action_tokens_service_returns_ids_and_actions_of_the_requested_shape(served):
    client, _ = served
    resp = client.action_tokens(instruction="pick up the red cup", observation=[0.1] * 8, num_actions=2)
    assert resp.success, resp.message
    assert resp.num_actions == 2 and resp.action_dims > 0
    assert len(resp.token_ids) == 2 * resp.action_dims
    assert len(resp.actions) == resp.num_actions * resp.action_dims
    assert all(math.isfinite(a) for a in resp.actions)
    text_obs = client.action_tokens(instruction="pick up the red cup", observation_text="cup 0.4 m ahead")
    assert text_obs.success and text_obs.num_actions >= 1


def test_generate_streams_feedback_in_order_and_the_result_holds_the_full_text(served):
    client, _ = served
    accepted, status, result, feedback = client.generate(prompt="navigate to the kitchen", max_tokens=400)
    assert accepted and result.success, result.message
    assert status == 4  # GoalStatus.STATUS_SUCCEEDED
    assert result.finish_reason in ("eos", "max_tokens")
    assert len(feedback) >= 2, "400 tokens should take more than one feedback period"
    assert [f.seq for f in feedback] == list(range(len(feedback)))
    counts = [f.tokens for f in feedback]
    assert counts == sorted(counts) and counts[-1] == len(result.token_ids)
    assert "".join(f.text_delta for f in feedback) == result.text
    assert len(feedback) < len(result.token_ids), "feedback must be batched, not one message per token"


def test_cancel_stops_a_running_generation_and_returns_what_it_has(served):
    import rclpy

    client, _ = served
    feedback = []
    handle = client.send_goal(feedback.append, prompt="navigate to the kitchen", max_tokens=LONG)
    assert handle.accepted
    t0 = time.monotonic()
    while not feedback and time.monotonic() - t0 < 10:
        rclpy.spin_once(client.node, timeout_sec=0.05)
    assert feedback, "no feedback before cancelling"
    cancel = client._wait(handle.cancel_goal_async(), 10)
    assert len(cancel.goals_canceling) == 1
    status, result = client.result(handle)
    assert status == 5  # GoalStatus.STATUS_CANCELED
    assert result.finish_reason == "cancelled"
    assert 0 < len(result.token_ids) < LONG and result.text


def test_a_request_past_its_deadline_returns_its_partial_result(served):
    client, _ = served
    t0 = time.monotonic()
    resp = client.plan(instruction="bring the red cup", max_tokens=LONG, deadline_s=0.3)
    assert time.monotonic() - t0 < 2.0
    assert resp.success, resp.message
    assert resp.finish_reason == "deadline"
    assert 0 < resp.stats.tokens < LONG


def test_a_plan_under_a_schema_follows_it_token_by_token(served):
    client, _ = served
    with open(os.path.join(ROOT, "configs", "plan_schema.json")) as f:
        schema = f.read()
    resp = client.plan(instruction="bring the red cup to the table", max_tokens=48, schema=schema)
    assert resp.success, resp.message
    assert resp.text.startswith('[{"skill":"')  # random weights, yet the answer is a plan so far
    assert resp.plan_ok or resp.finish_reason == "max_tokens", (resp.text, resp.plan_error)
    assert 0 < resp.stats.grammar_s < resp.stats.wall_s  # the time spent on masks is reported
    assert client.plan(instruction="bring the red cup", max_tokens=8).stats.grammar_s == 0.0


@pytest.mark.parametrize("call, fields, field", [
    ("plan", dict(instruction=""), "instruction"),
    ("plan", dict(instruction="   "), "instruction"),
    # an over-long prompt: the runtime names the budget it breaks (prompt + max_tokens > context)
    ("plan", dict(instruction="bring the cup " * 4000), ("instruction", "prompt", "max_tokens")),
    ("plan", dict(instruction="bring the cup", max_tokens=100_000), "max_tokens"),
    ("plan", dict(instruction="bring the cup", temperature=float("nan")), "temperature"),
    ("plan", dict(instruction="bring the cup", deadline_s=float("inf")), "deadline_s"),
    ("plan", dict(instruction="bring the cup", schema="{not json"), "schema"),
    ("plan", dict(instruction="bring the cup", schema='{"type": "wat"}'), "schema"),
    ("action_tokens", dict(instruction="pick up the cup", observation=[0.1] * 3), "observation"),
    ("action_tokens", dict(instruction="pick up the cup", observation=[float("nan")] * 8), "observation"),
    ("action_tokens", dict(instruction="pick up the cup", num_actions=1000), "num_actions"),
])
def test_bad_requests_get_an_error_naming_the_field_and_the_node_keeps_serving(served, call, fields, field):
    client, node = served
    resp = getattr(client, call)(**fields)
    assert not resp.success
    assert resp.error_field in ((field,) if isinstance(field, str) else field), resp.message
    assert resp.message
    assert client.plan(instruction="open the drawer", max_tokens=4).success
    assert node.alive()


@pytest.mark.parametrize("fields, field, words", [
    (dict(observation=[0.1] * 8, observation_text="cup 0.4 m ahead"), "observation_text", ("only one of",)),
    (dict(observation=[1e30] + [0.1] * 7), "observation", ("observation[0]", "1e+30", "[-10, 10]")),
    (dict(observation=[0.1] * 7 + [-50.0]), "observation", ("observation[7]", "[-10, 10]")),
    (dict(observation=[0.1] * 3 + [float("nan")] + [0.1] * 4), "observation", ("observation[3]", "nan")),
], ids=["both-set", "1e30", "-50", "nan"])
def test_an_ambiguous_or_non_physical_observation_is_refused_naming_the_field_and_the_range(
        served, fields, field, words):
    client, _ = served
    resp = client.action_tokens(instruction="pick up the cup", **fields)
    assert not resp.success and resp.error_field == field, resp.message
    assert all(w in resp.message for w in words), resp.message


def test_a_generate_goal_with_an_empty_prompt_is_aborted_with_the_reason(served):
    client, _ = served
    accepted, status, result, _ = client.generate(prompt="")
    assert accepted
    assert status == 6  # GoalStatus.STATUS_ABORTED
    assert not result.success and result.error_field == "prompt"


def test_eight_concurrent_clients_all_get_their_answers(served, client_node):
    from edgespec_interfaces.srv import ActionTokens, Plan

    plans = [client_node.create_client(Plan, f"{PATH}/plan") for _ in range(5)]
    acts = [client_node.create_client(ActionTokens, f"{PATH}/action_tokens") for _ in range(3)]
    for c in plans + acts:
        assert c.wait_for_service(timeout_sec=10)
    futures = [c.call_async(Plan.Request(instruction=f"bring cup {i}", max_tokens=32)) for i, c in enumerate(plans)]
    futures += [c.call_async(ActionTokens.Request(instruction=f"pick cup {i}", observation=[0.0] * 8))
                for i, c in enumerate(acts)]
    spin_all(client_node, futures, timeout_s=60)
    answers = [f.result() for f in futures]
    assert all(a.success for a in answers), [a.message for a in answers if not a.success]
    assert max(a.stats.queue_s for a in answers) > 0  # they really waited for each other (batch 1)
    for c in plans + acts:
        client_node.destroy_client(c)


def test_action_requests_overtake_queued_plan_requests(served, client_node):
    import rclpy
    from edgespec_interfaces.srv import ActionTokens, Plan

    client, _ = served

    def queued(n: int):  # the node says so itself: no guess at how long a request takes to arrive
        return wait_for_diagnostics(client_node, PATH, lambda _s, v: int(v["queue_length"]) >= n)

    handle = client.send_goal(prompt="navigate to the kitchen", max_tokens=LONG)  # occupies the queue
    assert handle.accepted
    sent_plan = time.monotonic()
    plan_f = client.plan_client.call_async(Plan.Request(instruction="bring cup", max_tokens=4))
    queued(2)  # the plan request is queued first; the action request (8 x 7 tokens) comes later
    sent_action = time.monotonic()
    act_f = client.actions_client.call_async(ActionTokens.Request(instruction="pick cup", observation=[0.0] * 8,
                                                                  num_actions=8))
    queued(3)
    client._wait(handle.cancel_goal_async(), 10)
    t0 = time.monotonic()
    while not (plan_f.done() and act_f.done()) and time.monotonic() - t0 < 30:
        rclpy.spin_once(client_node, timeout_sec=0.005)
    plan, act = plan_f.result(), act_f.result()
    assert plan.success and act.success
    # which generation STARTED first, from the node's own queue times (sent + queue_s; the replies may cross on
    # the way back, as answers are sent on the threads that took them; served first, the action's whole generation
    # lies between the two starts)
    started_plan, started_action = sent_plan + plan.stats.queue_s, sent_action + act.stats.queue_s
    assert started_action < started_plan, "prioritise_actions: the later action request must be served first"
    client.result(handle)


def test_diagnostics_are_published_at_1hz_with_backend_drafter_memory_and_queue(served, client_node):
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray

    got = []
    sub = client_node.create_subscription(
        DiagnosticArray, "/diagnostics",
        lambda m: got.extend(s for s in m.status if s.name.endswith(PATH)), 10)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.3:
        rclpy.spin_once(client_node, timeout_sec=0.05)
    client_node.destroy_subscription(sub)
    assert 2 <= len(got) <= 5, f"{len(got)} diagnostics in 3.3 s at 1 Hz"
    status = got[-1]
    values = {kv.key: kv.value for kv in status.values}
    assert status.level == b"\x00", status.message  # OK
    assert values["state"] == "active"
    assert values["drafter"] == "draft_model" and values["backend"]
    assert int(values["memory_bytes"]) > 0
    for key in ("tau_last", "queue_length", "requests_served", "requests_failed", "last_error", "ttft_last_s"):
        assert key in values
    # earlier tests in this module sent requests: each one is a prefix-cache hit or a miss
    assert int(values["prefix_cache_hits"]) + int(values["prefix_cache_misses"]) >= 1
    assert int(values["prefix_cache_tokens_last"]) >= 0


def test_stats_are_published_on_a_topic_after_each_request(served, client_node):
    import rclpy
    from edgespec_interfaces.msg import DecodeStats

    got = []
    sub = client_node.create_subscription(DecodeStats, f"{PATH}/stats", got.append, 10)
    time.sleep(0.5)  # discovery of the new subscription
    client = served[0]
    future = client.plan_client.call_async(client.plan_client.srv_type.Request(instruction="open the drawer",
                                                                               max_tokens=6))
    spin_all(client_node, [future])
    t0 = time.monotonic()
    while not got and time.monotonic() - t0 < 5:
        rclpy.spin_once(client_node, timeout_sec=0.05)
    client_node.destroy_subscription(sub)
    assert got and got[-1].tokens == future.result().stats.tokens


def test_parameters_come_from_the_params_file_and_bad_values_are_refused(served, client_node):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import GetParameters, SetParameters

    client = served[0]
    get = client_node.create_client(GetParameters, f"{PATH}/get_parameters")
    put = client_node.create_client(SetParameters, f"{PATH}/set_parameters")
    assert get.wait_for_service(timeout_sec=10) and put.wait_for_service(timeout_sec=10)
    values = client._wait(get.call_async(GetParameters.Request(
        names=["default_max_tokens", "drafter", "queue_limit"])), 10).values
    assert [values[0].integer_value, values[1].string_value, values[2].integer_value] == [24, "draft_model", 16]

    def set_param(name, value):
        req = SetParameters.Request(parameters=[Parameter(name=name, value=value)])
        return client._wait(put.call_async(req), 10).results[0]

    out_of_range = set_param("diagnostics_period_s", ParameterValue(type=ParameterType.PARAMETER_DOUBLE,
                                                                    double_value=-1.0))
    assert not out_of_range.successful
    bad_name = set_param("drafter", ParameterValue(type=ParameterType.PARAMETER_STRING, string_value="Draft Model!"))
    assert not bad_name.successful and "drafter" in bad_name.reason
    read_only = set_param("queue_limit", ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=3))
    assert not read_only.successful
    ok = set_param("default_max_tokens", ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=5))
    assert ok.successful
    assert client.plan(instruction="open the drawer").stats.tokens <= 5
    client_node.destroy_client(get)
    client_node.destroy_client(put)
