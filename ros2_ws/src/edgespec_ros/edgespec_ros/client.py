"""A blocking client for one edgespec node (used by the demo, the tests and the command line; a planner node
would call the same services asynchronously from its own callbacks).

    client = EdgespecClient(node, "/spec/edgespec")
    client.plan(instruction="bring the red cup to the kitchen", max_tokens=64).text

Safe from several threads: it spins its node on its own executor, one thread at a time (rclpy's global
executor, which `spin_until_future_complete(node, ...)` uses, fails with "wait set index too big" when two
threads spin it). A call fails fast, with NodeGone, once the served node has been absent from the ROS graph
for `absent_grace_s` (a crashed or stopped node), instead of waiting out its whole timeout.

From a shell (the node's QoS included, which `ros2 service call` lacks):

    python -m edgespec_ros.client plan "bring the red cup to the kitchen" --node /spec/edgespec
    python -m edgespec_ros.client action "pick up the red cup" --observation 0.1 0 0.3 0 1 0.4 0.1 0.02
    python -m edgespec_ros.client generate "<|bos|><|text|>To be" --max-tokens 32 --stream
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import weakref
from typing import Callable, List, Optional

import rclpy
from edgespec_interfaces.action import Generate
from edgespec_interfaces.srv import ActionTokens, Plan
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from edgespec_ros.qos import REQUEST_QOS, action_qos_kwargs

SPIN_S = 0.02  # one spin of the client's executor; waiters take turns at this pace
GRAPH_CHECK_S = 0.25  # how often a waiting call looks for the served node in the graph
FEEDBACK_TAIL_S = 0.1  # after a goal's result, how long to wait for feedback still missing (a topic may drop it)


_SPINNERS: "weakref.WeakKeyDictionary[Node, tuple]" = weakref.WeakKeyDictionary()
_SPINNERS_LOCK = threading.Lock()


def _spinner(node: Node) -> tuple:
    """(executor, lock) shared by every client on `node`: one executor per node, spun by one thread at a time."""
    with _SPINNERS_LOCK:
        if node not in _SPINNERS:
            _SPINNERS[node] = (SingleThreadedExecutor(context=node.context), threading.Lock())
        return _SPINNERS[node]


def feedback_complete(feedback: List[Generate.Feedback], result) -> bool:
    """Whether the feedback streamed so far covers every token of the result (the node flushes its feedback
    before it answers: the last message's `tokens` is the result's token count)."""
    if result is None or not result.token_ids:
        return True
    return bool(feedback) and feedback[-1].tokens >= len(result.token_ids)


class NodeGone(TimeoutError):
    """The served node is not in the ROS graph (stopped, crashed, or never started): no answer will come."""


class EdgespecClient:
    def __init__(self, node: Node, node_path: str = "/edgespec", absent_grace_s: float = 3.0):
        """`node_path`: the served node's fully qualified name, e.g. /spec/edgespec. `absent_grace_s`: how long
        the served node may be missing from the graph before a waiting call gives up (discovery can lag)."""
        self.node = node
        self.path = node_path.rstrip("/")
        self.absent_grace_s = absent_grace_s
        namespace, _, name = self.path.rpartition("/")
        self._name = (name, namespace or "/")
        self._executor, self._spin_lock = _spinner(node)
        self.plan_client = node.create_client(Plan, f"{self.path}/plan", qos_profile=REQUEST_QOS)
        self.actions_client = node.create_client(ActionTokens, f"{self.path}/action_tokens", qos_profile=REQUEST_QOS)
        self.generate_client = ActionClient(node, Generate, f"{self.path}/generate", **action_qos_kwargs())
        self.change_state_client = node.create_client(ChangeState, f"{self.path}/change_state")
        self.get_state_client = node.create_client(GetState, f"{self.path}/get_state")

    # -- plumbing --
    def spin_once(self, timeout_s: float = SPIN_S) -> None:
        """Run the node's ready callbacks (responses, feedback) on this client's executor, one thread at a time.
        The node joins the executor only for the spin, so the caller may still spin it elsewhere in between."""
        if not self._spin_lock.acquire(timeout=timeout_s):
            return  # another thread is spinning: it delivers this thread's answers too
        try:
            self._executor.add_node(self.node)
            try:
                self._executor.spin_once(timeout_sec=timeout_s)
            finally:
                self._executor.remove_node(self.node)
        finally:
            self._spin_lock.release()

    def node_present(self) -> bool:
        return self._name in self.node.get_node_names_and_namespaces()

    def _wait(self, future, timeout_s: float):
        """The future's result; TimeoutError after `timeout_s`, NodeGone once the served node has been absent
        from the graph for absent_grace_s."""
        start = time.monotonic()
        deadline = start + timeout_s
        absent_since: Optional[float] = None
        next_check = start
        while not future.done():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no answer from {self.path} within {timeout_s} s")
            if now >= next_check:
                next_check = now + GRAPH_CHECK_S
                if self.node_present():
                    absent_since = None
                elif absent_since is None:
                    absent_since = now
                elif now - absent_since >= self.absent_grace_s:
                    future.cancel()
                    raise NodeGone(f"{self.path} is not in the ROS graph (absent for {now - absent_since:.1f} s): "
                                   "it stopped or crashed; no answer will come. Check that it runs "
                                   "(`ros2 node list`) and in this ROS_DOMAIN_ID")
            self.spin_once(min(SPIN_S, max(0.0, deadline - now)))
        return future.result()

    wait = _wait

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

    def generate(self, timeout_s: float = 120.0, on_feedback: Optional[Callable[[Generate.Feedback], None]] = None,
                 **fields):
        """Streamed generation: (accepted, status, result, feedback list)."""
        feedback: List[Generate.Feedback] = []

        def got(msg) -> None:
            feedback.append(msg)
            if on_feedback is not None:
                on_feedback(msg)

        handle = self.send_goal(got, **fields)
        if not handle.accepted:
            return False, None, None, feedback
        status, result = self.result(handle, timeout_s)
        # Feedback is a topic and the result a service: the last feedback may land just after the result. Wait
        # only while some is missing: a fixed 0.1 s wait was most of a goal's cost (0.15 s for 47.5 ms of work).
        t0 = time.monotonic()
        while not feedback_complete(feedback, result) and time.monotonic() - t0 < FEEDBACK_TAIL_S:
            self.spin_once()
        return True, status, result, feedback


# ---------------------------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m edgespec_ros.client",
                                description="Send one request to a running edgespec node and print the answer.")
    p.add_argument("--node", default="/edgespec", help="the node's fully qualified name (default /edgespec)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    p.add_argument("--json", action="store_true", help="print the whole answer as one JSON object")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="a plan (JSON steps) for an instruction")
    plan.add_argument("instruction")
    plan.add_argument("--context", default="")
    plan.add_argument("--observation", default="", help="the observation as text")
    plan.add_argument("--schema", metavar="FILE", help="a JSON Schema file the plan must satisfy")
    act = sub.add_parser("action", help="action tokens for an instruction and an observation")
    act.add_argument("instruction")
    obs = act.add_mutually_exclusive_group(required=True)
    obs.add_argument("--observation", type=float, nargs="+", help="the observation as numbers")
    obs.add_argument("--observation-text", help="the observation as text")
    act.add_argument("--num-actions", type=int, default=0, help="0 = the node's default chunk")
    gen = sub.add_parser("generate", help="free generation, streamed")
    gen.add_argument("prompt", help="the model's raw input (control tokens such as <|bos|> are the caller's)")
    gen.add_argument("--stream", action="store_true", help="print the text as it streams in")
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    for s in (plan, act, gen):
        s.add_argument("--temperature", type=float, default=0.0)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--deadline", type=float, default=0.0, help="seconds; 0 = none")
    for s in (plan, gen):
        s.add_argument("--max-tokens", type=int, default=0, help="0 = the node's default")
    return p


def _fields(msg) -> dict:
    """A response / result as plain JSON-able values (its stats included)."""
    out = {}
    for name in msg.get_fields_and_field_types():
        v = getattr(msg, name)
        out[name] = _fields(v) if hasattr(v, "get_fields_and_field_types") else (
            [float(x) if isinstance(x, float) else x for x in v] if not isinstance(v, (str, bytes, int, float, bool))
            else v)
    return out


def _request(client: EdgespecClient, args) -> tuple:
    """(success, the answer message) for the parsed command."""
    common = dict(temperature=args.temperature, seed=args.seed, deadline_s=args.deadline)
    if args.command == "plan":
        schema = ""
        if args.schema:
            with open(args.schema, encoding="utf-8") as f:
                schema = f.read()
        resp = client.plan(args.timeout, instruction=args.instruction, context=args.context,
                           observation=args.observation, schema=schema, max_tokens=args.max_tokens, **common)
        return resp.success, resp
    if args.command == "action":
        resp = client.action_tokens(args.timeout, instruction=args.instruction, observation=args.observation or [],
                                    observation_text=args.observation_text or "", num_actions=args.num_actions,
                                    **common)
        return resp.success, resp
    stream = args.stream and not args.json
    on_feedback = (lambda f: (sys.stdout.write(f.text_delta), sys.stdout.flush())) if stream else None
    accepted, _status, result, _ = client.generate(args.timeout, on_feedback=on_feedback, prompt=args.prompt,
                                                   max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k,
                                                   **common)
    if stream:
        print()
    if not accepted:
        raise SystemExit(f"{args.node}: the generate goal was rejected (node not active, or its queue is full)")
    return result.success, result


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    rclpy.init()
    node = rclpy.create_node("edgespec_cli_client")
    try:
        client = EdgespecClient(node, args.node)
        try:
            client.wait_for_services(timeout_s=min(args.timeout, 10.0))
            ok, answer = _request(client, args)
        except (TimeoutError, OSError) as exc:
            print(f"edgespec client: error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(_fields(answer)))
        elif not ok:
            print(f"edgespec client: refused: error_field {answer.error_field!r}: {answer.message}", file=sys.stderr)
        elif args.command == "plan":
            print(answer.text)
            print(f"-- plan {'valid' if answer.plan_ok else 'INVALID: ' + answer.plan_error}; "
                  f"finish={answer.finish_reason}; {answer.stats.tokens} tokens, tau {answer.stats.tau:.2f}")
        elif args.command == "action":
            dims = max(1, answer.action_dims)
            for i in range(answer.num_actions):
                print(" ".join(f"{a:+.3f}" for a in answer.actions[i * dims:(i + 1) * dims]))
        elif not args.stream:
            print(answer.text)
        return 0 if ok else 1
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
