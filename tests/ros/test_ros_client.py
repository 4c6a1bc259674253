"""The project's client (edgespec_ros/client.py): safe from several threads, fails fast when the served node
goes away (its absence from the graph, after a short grace), and a command line for one request."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

from tests.ros.conftest import ROOT, connect, start_node

NS = "/cli"
PATH = f"{NS}/edgespec"
PARAMS = {"drafter": "draft_model", "autostart": True, "max_context": 8192, "default_max_tokens": 8}


@pytest.fixture(scope="module")
def served(tiny_bundle, client_node, tmp_path_factory):
    node = start_node(str(tmp_path_factory.mktemp("cli")), NS, {**PARAMS, "bundle": tiny_bundle})
    client = connect(client_node, node, PATH)
    yield client, node
    assert node.stop() == 0, node.log()


def test_one_client_serves_calls_from_five_threads_at_once(served):
    client, _ = served
    answers, errors = [], []

    def calls(i: int) -> None:
        try:
            for j in range(4):
                answers.append(client.plan(instruction=f"bring cup {i}.{j}", max_tokens=4))
        except Exception as exc:  # rclpy's global executor: "wait set index too big", RCLError out of bounds
            errors.append(repr(exc))

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(answers) == 20 and all(a.success for a in answers), [a.message for a in answers if not a.success]


def test_a_call_to_a_node_that_dies_fails_with_node_gone_not_at_its_timeout(tiny_bundle, client_node, tmp_path):
    from edgespec_ros.client import NodeGone

    node = start_node(str(tmp_path), "/dying", {**PARAMS, "bundle": tiny_bundle})
    try:
        client = connect(client_node, node, "/dying/edgespec")
        handle = client.send_goal(prompt="navigate to the kitchen", max_tokens=8000)
        assert handle.accepted
        node.proc.send_signal(signal.SIGKILL)  # a crash: no goodbye, no answer
        with pytest.raises(NodeGone, match="not in the ROS graph"):
            client.result(handle, timeout_s=600)
        with pytest.raises(NodeGone):
            client.plan(timeout_s=600, instruction="bring the cup")
    finally:
        node.stop()


def test_a_call_to_a_node_that_never_ran_fails_with_node_gone(client_node):
    from edgespec_ros.client import EdgespecClient, NodeGone

    with pytest.raises(NodeGone):
        EdgespecClient(client_node, "/nowhere/edgespec", absent_grace_s=0.5).plan(timeout_s=600, instruction="go")


def _cli(*args, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec_ros.client", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def test_the_command_line_sends_a_plan_an_action_and_a_generate_request(served):
    run = _cli("--node", PATH, "--json", "plan", "bring the red cup", "--max-tokens", "4")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["success"] and answer["stats"]["tokens"] >= 1 and answer["stats"]["drafter"] == "draft_model"

    run = _cli("--node", PATH, "action", "pick up the cup", "--observation", *["0.1"] * 8, "--num-actions", "2")
    assert run.returncode == 0, run.stderr
    rows = run.stdout.strip().splitlines()
    assert len(rows) == 2 and all(len(r.split()) == len(rows[0].split()) >= 1 for r in rows)

    run = _cli("--node", PATH, "--json", "generate", "navigate to", "--max-tokens", "6")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["success"]


def test_the_command_line_reports_a_refusal_with_its_field_and_exit_code_1(served):
    run = _cli("--node", PATH, "plan", "   ")
    assert run.returncode == 1 and "error_field 'instruction'" in run.stderr, run.stderr


def test_the_command_line_says_when_the_node_is_not_there(ros_env):
    run = _cli("--node", "/nowhere/edgespec", "--timeout", "2", "plan", "go")
    assert run.returncode == 2 and "/nowhere/edgespec" in run.stderr and "Traceback" not in run.stderr
