"""The node under abuse (issue 33): requests over the size limits are refused before any work, naming the
field; fields are named as the client sent them; bad sampling values are refused; a full queue is load, not
failure; schemas beyond the grammar engine are refused as the schema's fault; every configure failure is an
ERROR on /diagnostics with its reason, also one that only a request through the drafter shows."""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.ros.conftest import HERE, connect, spin_all, start_node, wait_for_diagnostics

NS = "/abuse"
PATH = f"{NS}/edgespec"
LIMITS = {"max_instruction_chars": 5000, "max_context_chars": 6000, "max_prompt_chars": 400, "max_schema_chars": 200_000}
OK, WARN, ERROR = b"\x00", b"\x01", b"\x02"
LONG = 1000  # tokens: the longest answer max_context 1024 holds, seconds on the tiny bundle
WIDE = {"anyOf": [{"type": "object", "properties": {"skill": {"const": f"s{i}"}}, "required": ["skill"]}
                  for i in range(2500)]}


@pytest.fixture(scope="module")
def served(tiny_bundle, client_node, tmp_path_factory):
    node = start_node(str(tmp_path_factory.mktemp("abuse")), NS,
                      {"bundle": tiny_bundle, "drafter": "draft_model", "autostart": True, "queue_limit": 1,
                       "max_context": 1024, "default_max_tokens": 8, "diagnostics_period_s": 0.2, **LIMITS})
    client = connect(client_node, node, PATH)
    yield client, node
    assert node.stop() == 0, node.log()


def _values(client_node):
    return wait_for_diagnostics(client_node, PATH)[1]


@pytest.mark.parametrize("call,fields,field", [
    ("plan", {"instruction": "x" * 5001}, "instruction"),
    ("plan", {"instruction": "go", "context": "x" * 6001}, "context"),
    ("plan", {"instruction": "go", "observation": "x" * 6001}, "observation"),
    ("action_tokens", {"instruction": "go", "observation_text": "x" * 6001}, "observation_text"),
    ("plan", {"instruction": "x" * 1_000_000}, "instruction"),  # a megabyte: refused by its length alone
])
def test_a_request_over_a_size_limit_is_refused_naming_the_field_and_the_parameter(served, call, fields, field):
    client, node = served
    resp = getattr(client, call)(**fields)
    assert not resp.success and resp.error_field == field, resp.message
    assert f"max_{'instruction' if field == 'instruction' else 'context'}_chars" in resp.message
    assert resp.stats.tokens == 0 and node.alive()


def test_a_generate_prompt_over_its_limit_is_refused_naming_prompt(served):
    client, _ = served
    accepted, _status, result, _ = client.generate(prompt="x" * 401)
    assert accepted and not result.success and result.error_field == "prompt" and "max_prompt_chars" in result.message


@pytest.mark.parametrize("field", ["instruction", "context", "observation"])
def test_a_plan_too_long_for_the_context_names_the_long_field_not_prompt(served, field):
    client, _ = served
    fields = {"instruction": "bring the cup", field: "the red cup " * 400}  # within the chars, over 1024 tokens
    resp = client.plan(**fields)
    assert not resp.success and resp.error_field == field, (resp.error_field, resp.message)


@pytest.mark.parametrize("top_p", [math.nan, -0.5, 1.5])
def test_a_generate_goal_with_a_top_p_outside_0_1_is_refused_naming_top_p(served, top_p):
    client, _ = served
    accepted, _status, result, _ = client.generate(prompt="hello", top_p=top_p, max_tokens=4)
    assert accepted and not result.success and result.error_field == "top_p", result.message


def test_the_boolean_schema_true_is_accepted(served):
    client, _ = served
    resp = client.plan(instruction="bring the cup", schema="true", max_tokens=4)
    assert resp.success, resp.message


@pytest.mark.parametrize("schema", [json.dumps(WIDE), '{"type":"array","items":' * 10_000 + "{}" + "}" * 10_000],
                         ids=["anyOf-2500", "nested-10000"])
def test_a_schema_beyond_the_grammar_engine_is_refused_as_the_schemas_fault(served, client_node, schema):
    client, node = served
    resp = client.plan(instruction="bring the cup", schema=schema, max_tokens=4)
    assert not resp.success and resp.error_field == "schema", resp.message
    assert resp.finish_reason != "error"
    status, values = wait_for_diagnostics(client_node, PATH)
    assert status.level == OK, (status.message, values)  # the request's fault: the backend is fine
    assert "Traceback" not in node.log()


def test_queue_refusals_are_counted_as_load_not_as_failed_requests(served, client_node):
    from edgespec_interfaces.srv import Plan

    client, _ = served
    before = _values(client_node)
    handle = client.send_goal(prompt="navigate to the kitchen", max_tokens=LONG)  # fills queue_limit=1
    assert handle.accepted
    futures = [client.plan_client.call_async(Plan.Request(instruction="bring the cup", max_tokens=4))
               for _ in range(3)]
    spin_all(client_node, futures)
    client._wait(handle.cancel_goal_async(), 10)
    client.result(handle)
    refused = [f.result() for f in futures if f.result().error_field == "queue"]
    assert refused, "the running goal should have filled the queue"
    _, after = wait_for_diagnostics(
        client_node, PATH, lambda _s, v: int(v["requests_refused_queue_full"]) >= int(before["requests_refused_queue_full"]) + len(refused))
    answers = [(f.result().error_field, f.result().message[:80]) for f in futures]
    assert int(after["requests_failed"]) == int(before["requests_failed"]), (answers, before, after)


def test_a_goal_accepted_in_a_burst_is_served_never_aborted_for_a_full_queue(served, client_node):
    from edgespec_interfaces.action import Generate
    from edgespec_interfaces.srv import Plan

    client, _ = served  # queue_limit=1
    # the burst starts on an idle node (an earlier test's request may still hold the one slot for a moment), and
    # its first goal is accepted before anything else is sent: the other goals race the plans for the slot
    wait_for_diagnostics(client_node, PATH, lambda _s, v: int(v["queue_length"]) == 0 and v["busy"] == "False")
    first = client.generate_client.send_goal_async(Generate.Goal(prompt="navigate 0", max_tokens=4))
    spin_all(client_node, [first])
    sent, plans = [first], []
    for i in range(8):  # plans arriving between a goal's acceptance and its execution took its place
        if i:
            sent.append(client.generate_client.send_goal_async(Generate.Goal(prompt=f"navigate {i}", max_tokens=4)))
        plans += [client.plan_client.call_async(Plan.Request(instruction=f"cup {i}.{j}", max_tokens=2))
                  for j in range(3)]
    spin_all(client_node, sent + plans)
    accepted = [f.result() for f in sent if f.result().accepted]
    assert first.result().accepted, "the first goal, sent alone to an idle node, finds the queue free"
    results = [client.result(h)[1] for h in accepted]
    assert [(r.success, r.error_field) for r in results] == [(True, "")] * len(results), \
        [r.message for r in results]


# ---------------------------------------------------------------------------------------------- configure

def _set(client, client_node, name: str, value: str) -> None:
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    put = client_node.create_client(SetParameters, f"{client.path}/set_parameters")
    assert put.wait_for_service(timeout_sec=10)
    req = SetParameters.Request(parameters=[Parameter(
        name=name, value=ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value))])
    assert client._wait(put.call_async(req), 10).results[0].successful
    client_node.destroy_client(put)


def test_every_configure_failure_is_an_error_on_diagnostics_with_its_reason(tiny_bundle, client_node, tmp_path):
    import sys
    sys.path.insert(0, HERE)
    from configure_faults_node import TYPE_ERROR, UNREADABLE

    path = "/conffault/edgespec"
    node = start_node(str(tmp_path), "/conffault", {"bundle": tiny_bundle, "drafter": "draft_model",
                                                    "autostart": False, "diagnostics_period_s": 0.2},
                      script=os.path.join(HERE, "configure_faults_node.py"))
    try:
        client = connect(client_node, node, path, state="unconfigured")
        # an exception that is not edgespec's own (a PermissionError on a data file)
        _set(client, client_node, "bundle", os.path.join(str(tmp_path), UNREADABLE))
        assert not client.change_state("configure") and client.state() == "unconfigured"
        status, values = wait_for_diagnostics(client_node, path, lambda s, _v: s.level == ERROR)
        assert "PermissionError" in values["configure_error"] and "Permission denied" in status.message
        # a session that opens but whose drafter cannot run: only a request shows it
        _set(client, client_node, "bundle", tiny_bundle)
        _set(client, client_node, "drafter", "ngram")
        assert not client.change_state("configure") and client.state() == "unconfigured"
        status, values = wait_for_diagnostics(client_node, path, lambda s, v: s.level == ERROR
                                              and "warm-up" in v["configure_error"])
        assert TYPE_ERROR in values["configure_error"] and "PermissionError" not in status.message
        # the same bundle with a drafter that runs: configured, and the old reason is gone
        _set(client, client_node, "drafter", "draft_model")
        assert client.change_state("configure")
        status, values = wait_for_diagnostics(client_node, path, lambda _s, v: v["state"] == "inactive")
        assert values["configure_error"] == "" and status.level == WARN  # inactive: not serving yet
        log = node.log()
        assert log.count("configure failed") == 2 and "PermissionError" in log and TYPE_ERROR in log
    finally:
        assert node.stop() == 0, node.log()


# ---------------------------------------------------------------------------------------------- bundle files

def test_a_bundle_changed_under_the_running_node_is_reported_and_a_reconfigure_loads_it(
        tiny_bundle, client_node, tmp_path):
    import shutil

    bundle = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, bundle)
    weights = os.path.join(bundle, "target", "model.safetensors")
    path = "/changed/edgespec"
    node = start_node(str(tmp_path), "/changed", {"bundle": bundle, "drafter": "draft_model", "autostart": True,
                                                  "diagnostics_period_s": 0.2})
    try:
        client = connect(client_node, node, path)
        os.rename(weights, weights + ".moved")  # e.g. a re-export next to the running node
        resp = client.plan(instruction="bring the cup", max_tokens=4)
        assert resp.success, resp.message  # the model is in memory: nothing is read again per request
        status, values = wait_for_diagnostics(client_node, path, lambda s, _v: s.level == WARN)
        assert values["bundle_changed"] == "target/model.safetensors (missing)"
        assert "target/model.safetensors (missing)" in status.message and "reconfigure" in status.message
        shutil.copyfile(weights + ".moved", weights)  # the new export in place (same content, new file)
        assert client.change_state("deactivate") and client.change_state("cleanup")
        assert client.change_state("configure") and client.change_state("activate")
        status, values = wait_for_diagnostics(client_node, path, lambda s, v: v["state"] == "active")
        assert status.level == OK and values["bundle_changed"] == "", status.message
    finally:
        assert node.stop() == 0, node.log()
