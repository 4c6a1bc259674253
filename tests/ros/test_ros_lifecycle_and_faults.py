"""Lifecycle transitions, refusals while not active, a full queue, a bad params file and a backend
failure mid-generation: each gets a clear answer and the node keeps serving."""
from __future__ import annotations

import os
import sys
import time

import pytest

from tests.ros.conftest import HERE, connect, spin_all, start_node, wait_for_diagnostics

NS = "/life"
PATH = f"{NS}/edgespec"
LONG = 8000  # tokens: many seconds on the tiny bundle; the tests cancel it or deactivate
OK, WARN = b"\x00", b"\x01"  # DiagnosticStatus levels


def _diagnostics(client_node, path: str, timeout_s: float = 3.0):
    """The next /diagnostics status of the node at `path`, as (status, {key: value})."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray

    got = []
    sub = client_node.create_subscription(
        DiagnosticArray, "/diagnostics", lambda m: got.extend(s for s in m.status if s.name.endswith(path)), 10)
    t0 = time.monotonic()
    while not got and time.monotonic() - t0 < timeout_s:
        rclpy.spin_once(client_node, timeout_sec=0.05)
    client_node.destroy_subscription(sub)
    assert got, f"no diagnostics from {path} within {timeout_s} s"
    return got[-1], {kv.key: kv.value for kv in got[-1].values}


@pytest.fixture(scope="module")
def managed(tiny_bundle, client_node, tmp_path_factory):
    """A node without autostart: it waits unconfigured for lifecycle transitions."""
    node = start_node(str(tmp_path_factory.mktemp("life")), NS,
                      {"bundle": tiny_bundle, "autostart": False, "queue_limit": 2, "diagnostics_period_s": 0.5,
                       "max_context": 8192})
    client = connect(client_node, node, PATH, state="unconfigured")
    yield client, node, tiny_bundle
    assert node.stop() == 0, node.log()


def _set_bundle(client, client_node, value: str) -> None:
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    put = client_node.create_client(SetParameters, f"{PATH}/set_parameters")
    assert put.wait_for_service(timeout_sec=10)
    req = SetParameters.Request(parameters=[Parameter(
        name="bundle", value=ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value))])
    assert client._wait(put.call_async(req), 10).results[0].successful
    client_node.destroy_client(put)


def _ensure_active(client) -> None:
    if client.state() == "unconfigured":
        assert client.change_state("configure")
    if client.state() == "inactive":
        assert client.change_state("activate")
    assert client.state() == "active"


def test_lifecycle_configure_activate_deactivate_cleanup(managed, client_node):
    client, _node, _bundle = managed
    refused = client.plan(instruction="bring the cup")
    assert not refused.success and refused.error_field == "state" and "unconfigured" in refused.message
    rejected = client.send_goal(prompt="hello")
    assert not rejected.accepted

    assert client.change_state("configure") and client.state() == "inactive"
    inactive = client.action_tokens(instruction="pick up the cup")
    assert not inactive.success and inactive.error_field == "state" and "inactive" in inactive.message
    _status, values = _diagnostics(client_node, PATH)
    assert values["state"] == "inactive" and int(values["memory_bytes"]) > 0

    assert client.change_state("activate") and client.state() == "active"
    assert client.plan(instruction="bring the cup", max_tokens=4).success
    accepted, _, result, _ = client.generate(prompt="hello", max_tokens=8)
    assert accepted and result.success

    assert client.change_state("deactivate") and client.state() == "inactive"
    assert client.plan(instruction="bring the cup").error_field == "state"
    assert client.change_state("cleanup") and client.state() == "unconfigured"
    status, values = _diagnostics(client_node, PATH)
    assert values["state"] == "unconfigured" and int(values["memory_bytes"]) == 0
    assert status.level == b"\x01"  # WARN: not serving


def test_configure_with_a_missing_bundle_fails_with_the_reason_and_can_be_retried(managed, client_node):
    client, _node, bundle = managed
    _set_bundle(client, client_node, "/nonexistent/bundle")
    assert not client.change_state("configure")
    assert client.state() == "unconfigured"
    status, values = _diagnostics(client_node, PATH)
    assert status.level == b"\x02" and "nonexistent" in status.message  # ERROR, naming the bundle
    _set_bundle(client, client_node, bundle)
    assert client.change_state("configure") and client.change_state("activate")
    assert client.plan(instruction="bring the cup", max_tokens=4).success


def test_a_full_queue_refuses_requests_with_a_clear_error(managed, client_node):
    from edgespec_interfaces.srv import Plan

    client, _node, _bundle = managed
    _ensure_active(client)
    handle = client.send_goal(prompt="navigate to the kitchen", max_tokens=LONG)  # 1 of queue_limit=2
    assert handle.accepted
    time.sleep(0.2)
    futures = [client.plan_client.call_async(Plan.Request(instruction=f"bring cup {i}", max_tokens=4))
               for i in range(3)]
    time.sleep(0.5)
    rejected_goal = client.send_goal(prompt="hello")
    client._wait(handle.cancel_goal_async(), 10)
    spin_all(client_node, futures)
    answers = [f.result() for f in futures]
    full = [a for a in answers if not a.success]
    assert len(full) == 2 and all(a.error_field == "queue" and "queue_limit=2" in a.message for a in full)
    assert sum(a.success for a in answers) == 1
    assert not rejected_goal.accepted
    client.result(handle)


def test_deactivate_during_a_generation_stops_it_and_tells_the_client(managed):
    client, _node, _bundle = managed
    _ensure_active(client)
    handle = client.send_goal(prompt="navigate to the kitchen", max_tokens=LONG)
    assert handle.accepted
    time.sleep(0.3)
    assert client.change_state("deactivate")  # the lifecycle service runs while the generation does
    status, result = client.result(handle)
    assert status == 6 and not result.success  # ABORTED
    assert result.error_field == "state" and result.finish_reason == "cancelled"
    assert 0 < len(result.token_ids) < LONG
    assert client.change_state("activate")
    assert client.plan(instruction="bring the cup", max_tokens=4).success


def test_a_bad_params_file_stops_the_node_at_start_with_the_parameter_named(tmp_path):
    node = start_node(str(tmp_path), "/badparams", {"queue_limit": 0})
    try:
        node.proc.wait(timeout=30)
    finally:
        rc = node.stop()
    assert rc == 2
    assert "queue_limit" in node.log()


def test_a_backend_failure_mid_generation_fails_that_request_and_the_node_keeps_serving(
        tiny_bundle, client_node, tmp_path):
    sys.path.insert(0, HERE)
    from faulty_node import FAULT_MARKER

    path = "/faulty/edgespec"
    node = start_node(str(tmp_path), "/faulty", {"bundle": tiny_bundle, "autostart": True,
                                                 "diagnostics_period_s": 0.1},
                      script=os.path.join(HERE, "faulty_node.py"))
    try:
        client = connect(client_node, node, path)
        accepted, status, result, feedback = client.generate(prompt=f"navigate {FAULT_MARKER}", max_tokens=200)
        assert accepted and status == 6  # ABORTED
        assert not result.success and "BackendError" in result.message and "injected fault" in result.message
        assert feedback, "the fault came after tokens had been streamed"
        streamed = "".join(f.text_delta for f in feedback)
        assert streamed and result.text == streamed, "the result keeps the partial text that was streamed"
        assert len(result.token_ids) == feedback[-1].tokens and result.finish_reason == "error"
        status, values = wait_for_diagnostics(client_node, path, lambda s, _v: s.level == WARN)
        assert "injected fault" in values["last_error"] and "injected fault" in status.message
        assert float(values["last_error_age_s"]) >= 0 and int(values["requests_failed"]) >= 1

        again = client.generate(prompt="navigate to the kitchen", max_tokens=16)
        assert again[0] and again[2].success, again[2].message
        # A success clears the warning; the last error stays on record with its age.
        _, values = wait_for_diagnostics(client_node, path, lambda s, _v: s.level == OK)
        assert "injected fault" in values["last_error"] and float(values["last_error_age_s"]) >= 0

        assert not client.generate(prompt=f"navigate {FAULT_MARKER}", max_tokens=200)[2].success
        wait_for_diagnostics(client_node, path, lambda s, _v: s.level == WARN)
        assert client.change_state("deactivate") and client.change_state("activate")
        wait_for_diagnostics(client_node, path, lambda s, v: s.level == OK and v["state"] == "active")
        assert node.alive()
    finally:
        assert node.stop() == 0, node.log()


def test_after_the_shutdown_transition_requests_are_told_the_node_is_finalized(tiny_bundle, client_node, tmp_path):
    node = start_node(str(tmp_path), "/finalized", {"bundle": tiny_bundle, "autostart": True,
                                                    "diagnostics_period_s": 0.1})
    try:
        client = connect(client_node, node, "/finalized/edgespec")
        assert client.change_state("shutdown") and client.state() == "finalized"
        refused = client.plan(instruction="bring the cup", max_tokens=4)
        assert not refused.success and refused.error_field == "state"
        assert "finalized" in refused.message and "restart" in refused.message, refused.message
        assert "activate it first" not in refused.message
        assert not client.send_goal(prompt="hello").accepted
        wait_for_diagnostics(client_node, "/finalized/edgespec", lambda _s, v: v["state"] == "finalized")
    finally:
        assert node.stop() == 0, node.log()


def test_cleanup_gives_the_model_memory_back_over_many_configure_cleanup_cycles(tiny_bundle, client_node, tmp_path):
    def resident_bytes(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    path = "/cycles/edgespec"
    node = start_node(str(tmp_path), "/cycles", {"bundle": tiny_bundle, "autostart": False, "max_context": 32768,
                                                 "diagnostics_period_s": 0.1})
    try:
        client = connect(client_node, node, path, state="unconfigured")
        after_cleanup = []
        for _ in range(8):
            assert client.change_state("configure")
            _, values = wait_for_diagnostics(client_node, path, lambda _s, v: v["state"] == "inactive")
            model_bytes = int(values["memory_bytes"])
            assert client.change_state("cleanup")
            after_cleanup.append(resident_bytes(node.proc.pid))
    finally:
        assert node.stop() == 0, node.log()
    growth = after_cleanup[-1] - after_cleanup[0]
    # What cleanup kept would add up to a model per cycle (147 -> 289 MB on the zoo); allow a quarter of one.
    assert growth < model_bytes / 4, (f"resident memory after cleanup grew {growth / 2**20:.1f} MiB over "
                                      f"{len(after_cleanup)} cycles of a {model_bytes / 2**20:.1f} MiB model: "
                                      f"{[round(b / 2**20) for b in after_cleanup]} MiB")


def test_a_bad_drafter_shape_stops_the_node_at_start_naming_the_parameter_and_the_choices(tmp_path):
    node = start_node(str(tmp_path), "/badshape", {"drafter.shape": "diagonal"})
    try:
        node.proc.wait(timeout=30)
    finally:
        rc = node.stop()
    log = node.log()
    assert rc == 2, log
    assert "drafter.shape" in log and "'diagonal'" in log and "auto, fixed, adaptive" in log
    assert "Traceback" not in log


def test_the_drafter_shape_parameter_reaches_the_session_and_the_node_serves_with_it(tiny_bundle, client_node,
                                                                                        tmp_path):
    node = start_node(str(tmp_path), "/shape", {"bundle": tiny_bundle, "drafter": "draft_model", "autostart": True,
                                                "drafter.shape": "adaptive", "max_context": 1024})
    try:
        client = connect(client_node, node, "/shape/edgespec")
        resp = client.plan(instruction="bring the red cup", max_tokens=8)
        assert resp.success, resp.message
        assert "configured: drafter=draft_model shape=adaptive" in node.log()  # the session's shape, not the ask
    finally:
        assert node.stop() == 0, node.log()
