"""A blocking client for one edgespec node (used by the demo and the tests; a planner node would
call the same services asynchronously from its own callbacks)."""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import rclpy
from edgespec_interfaces.action import Generate
from edgespec_interfaces.srv import ActionTokens, Plan
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.action import ActionClient
from rclpy.node import Node

from edgespec_ros.qos import REQUEST_QOS, action_qos_kwargs


class EdgespecClient:
    def __init__(self, node: Node, node_path: str = "/edgespec"):
        """`node_path`: the served node's fully qualified name, e.g. /spec/edgespec."""
        self.node = node
        self.path = node_path.rstrip("/")
        self.plan_client = node.create_client(Plan, f"{self.path}/plan", qos_profile=REQUEST_QOS)
        self.actions_client = node.create_client(ActionTokens, f"{self.path}/action_tokens", qos_profile=REQUEST_QOS)
        self.generate_client = ActionClient(node, Generate, f"{self.path}/generate", **action_qos_kwargs())
        self.change_state_client = node.create_client(ChangeState, f"{self.path}/change_state")
        self.get_state_client = node.create_client(GetState, f"{self.path}/get_state")

    # -- plumbing --
    def _wait(self, future, timeout_s: float):
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=timeout_s)
        if not future.done():
            raise TimeoutError(f"no answer from {self.path} within {timeout_s} s")
        return future.result()

    def wait_for_services(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for client in (self.plan_client, self.actions_client, self.change_state_client, self.get_state_client):
            if not client.wait_for_service(timeout_sec=max(0.1, deadline - time.monotonic())):
                raise TimeoutError(f"{client.srv_name} not available after {timeout_s} s")
        if not self.generate_client.wait_for_server(timeout_sec=max(0.1, deadline - time.monotonic())):
            raise TimeoutError(f"{self.path}/generate not available after {timeout_s} s")

    def wait_until_state(self, label: str, timeout_s: float = 60.0) -> None:
        """Also the first round trip: a server that has not yet discovered this client's response reader
        drops its answer ("client will not receive response"), so an unanswered get_state is asked again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.state(timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))) == label:
                    return
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not reach state {label!r} within {timeout_s} s")
            time.sleep(0.1)

    # -- lifecycle --
    def state(self, timeout_s: float = 10.0) -> str:
        return self._wait(self.get_state_client.call_async(GetState.Request()), timeout_s).current_state.label

    def change_state(self, transition_label: str, timeout_s: float = 120.0) -> bool:
        req = ChangeState.Request()
        req.transition.label = transition_label
        return self._wait(self.change_state_client.call_async(req), timeout_s).success

    # -- requests --
    def plan(self, timeout_s: float = 120.0, **fields) -> Plan.Response:
        return self._wait(self.plan_client.call_async(Plan.Request(**fields)), timeout_s)

    def action_tokens(self, timeout_s: float = 120.0, **fields) -> ActionTokens.Response:
        return self._wait(self.actions_client.call_async(ActionTokens.Request(**fields)), timeout_s)

    def send_goal(self, on_feedback: Optional[Callable[[Generate.Feedback], None]] = None,
                  timeout_s: float = 30.0, **fields):
        """Returns the goal handle (check .accepted)."""
        fb = (lambda msg: on_feedback(msg.feedback)) if on_feedback else None
        return self._wait(self.generate_client.send_goal_async(Generate.Goal(**fields), feedback_callback=fb),
                          timeout_s)

    def result(self, goal_handle, timeout_s: float = 120.0):
        """(status, Generate.Result) of an accepted goal."""
        wrapped = self._wait(goal_handle.get_result_async(), timeout_s)
        return wrapped.status, wrapped.result

    def generate(self, timeout_s: float = 120.0, **fields):
        """Streamed generation: (accepted, status, result, feedback list)."""
        feedback: List[Generate.Feedback] = []
        handle = self.send_goal(feedback.append, **fields)
        if not handle.accepted:
            return False, None, None, feedback
        status, result = self.result(handle, timeout_s)
        # Feedback is a topic and the result a service: the last feedback may land just after the result.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.1:
            rclpy.spin_once(self.node, timeout_sec=0.02)
        return True, status, result, feedback
