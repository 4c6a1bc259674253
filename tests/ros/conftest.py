"""Shared set-up of the ROS 2 tests: an isolated DDS domain, nodes started as separate processes,
and a client node in this process.

Every test here is marked `ros` and skips (with the reason) when the ROS 2 wheels or the built
edgespec_interfaces are missing; `make test` installs them with scripts/bootstrap_ros.sh."""
from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _missing_ros() -> Optional[str]:
    for module, what in (("rclpy", "the ROS 2 wheels"), ("edgespec_interfaces", "the built edgespec_interfaces"),
                         ("edgespec_ros", "the edgespec_ros package")):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{what} ({module}) not installed: run scripts/bootstrap_ros.sh .venv"
        except (ImportError, ValueError):
            return f"{what} ({module}) not importable: run scripts/bootstrap_ros.sh .venv"
    return None


MISSING = _missing_ros()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.ros)
            if MISSING:
                item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def ros_env(tmp_path_factory) -> Dict[str, str]:
    """A private DDS domain on localhost for this test session (also inherited by the node processes)."""
    env = {
        "ROS_DOMAIN_ID": str(random.Random().randint(1, 101)),
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_LOG_DIR": str(tmp_path_factory.mktemp("ros_log")),
        "RCUTILS_COLORIZED_OUTPUT": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def rclpy_session(ros_env):
    import rclpy

    rclpy.init()
    yield rclpy
    rclpy.try_shutdown()


@pytest.fixture(scope="module")
def client_node(rclpy_session, request):
    node = rclpy_session.create_node(f"test_client_{request.module.__name__.split('.')[-1]}")
    yield node
    node.destroy_node()


class NodeProcess:
    """An edgespec node running as its own process; its output goes to `log_path`."""

    def __init__(self, args: List[str], log_path: str, cwd: str = ROOT, env: Optional[Dict[str, str]] = None):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def write_params(path: str, params: Dict[str, object]) -> str:
    with open(path, "w") as f:
        yaml.safe_dump({"/**": {"ros__parameters": params}}, f)
    return path


def start_node(tmp_dir: str, namespace: str, params: Dict[str, object],
               module: str = "edgespec_ros.node", script: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> NodeProcess:
    """Start a node named `edgespec` in `namespace` with `params` given as a params file."""
    tag = namespace.strip("/").replace("/", "_")
    params_file = write_params(os.path.join(tmp_dir, f"{tag}_params.yaml"), params)
    entry = [script] if script else ["-m", module]
    args = [sys.executable, "-u", *entry, "--ros-args", "-r", f"__ns:={namespace}", "--params-file", params_file]
    return NodeProcess(args, os.path.join(tmp_dir, f"{tag}_node.log"), env=env)


def connect(client_node, node: NodeProcess, path: str, state: Optional[str] = "active", timeout_s: float = 60.0):
    """An EdgespecClient for `path`, once its services are up (and the node in `state`)."""
    from edgespec_ros.client import EdgespecClient

    client = EdgespecClient(client_node, path)
    deadline = time.monotonic() + timeout_s
    try:
        client.wait_for_services(timeout_s)
        if state:
            client.wait_until_state(state, max(1.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        alive = node.alive()
        node.stop()  # the caller's fixture never gets to stop it
        raise AssertionError(f"{exc}; node alive={alive}; its log:\n{node.log()}") from None
    return client


def spin_all(node, futures, timeout_s: float = 60.0) -> None:
    """Spin `node` until every future is done."""
    import rclpy

    deadline = time.monotonic() + timeout_s
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, f"{sum(not f.done() for f in futures)} of {len(futures)} not answered"
        rclpy.spin_once(node, timeout_sec=0.05)


def wait_for_diagnostics(client_node, path: str, predicate=lambda status, values: True, timeout_s: float = 10.0):
    """The first /diagnostics status of the node at `path` that satisfies `predicate(status, values)`,
    as (status, {key: value}); fails with the last status seen when none does within `timeout_s`."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray

    got = []
    sub = client_node.create_subscription(
        DiagnosticArray, "/diagnostics", lambda m: got.extend(s for s in m.status if s.name.endswith(path)), 10)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            rclpy.spin_once(client_node, timeout_sec=0.05)
            for status in got:
                values = {kv.key: kv.value for kv in status.values}
                if predicate(status, values):
                    return status, values
            last, got[:] = got[-1:], []
    finally:
        client_node.destroy_subscription(sub)
    seen = [(s.level, s.message, {kv.key: kv.value for kv in s.values}) for s in last]
    raise AssertionError(f"no diagnostics from {path} satisfied the condition within {timeout_s} s; last: {seen}")
