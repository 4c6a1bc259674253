"""The edgespec lifecycle node: thin glue between ROS 2 and `runtime.serving.session.Session`.

    configure  -> Session.open(bundle, drafter, backend, max_context)   (parameters, e.g. configs/ros/edgespec.yaml)
    activate   -> serve ~/plan, ~/action_tokens (services) and ~/generate (action)
    deactivate -> stop serving: queued requests fail, a running generation is cancelled
    cleanup    -> Session.close() frees the model memory
    shutdown   -> finalized: requests are refused until the process restarts
    SIGINT/SIGTERM -> drain: refuse new requests, answer the queued ones, stop the running one, exit 0

Requests are served one at a time (batch 1) from a RequestQueue. ~/plan and ~/action_tokens live on a
hidden helper node served by a ServiceLoop (each request on the thread that took it from the wait set:
edgespec_ros.service_loop), ~/generate on another with its own MultiThreadedExecutor (edgespec_ros.request_node
says why), while the diagnostics timer and the lifecycle and parameter services run on this node's executor.
Uses only rclpy API common to Humble, Jazzy and Kilted.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from edgespec_interfaces.action import Generate
from edgespec_interfaces.msg import DecodeStats as DecodeStatsMsg
from edgespec_interfaces.srv import ActionTokens, Plan
from rclpy.action import ActionServer, CancelResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions

from edgespec_ros.drain import DrainMixin, drain
from edgespec_ros.health import HealthMixin
from edgespec_ros.lifecycle import LifecycleMixin
from edgespec_ros.pacing import AnswerPacer
from edgespec_ros.parameters import declare_parameters
from edgespec_ros.qos import REQUEST_QOS, action_qos_kwargs
from edgespec_ros.request_node import RequestSpinner, create_request_node, request_name
from edgespec_ros.request_queue import RequestQueue
from edgespec_ros.service_loop import ServiceLoop, as_service_callback
from edgespec_ros.serving import ServingMixin
from runtime.errors import EdgespecError
from runtime.serving.session import Session, return_large_blocks_on_free


class EdgespecNode(LifecycleMixin, ServingMixin, HealthMixin, DrainMixin, LifecycleNode):
    """One job per module: lifecycle, serving, health (diagnostics), drain; this class holds their state."""

    def __init__(self, node_name: str = "edgespec", **kwargs):
        super().__init__(node_name, **kwargs)
        self.p = declare_parameters(self)
        self.session: Optional[Session] = None
        self.queue = RequestQueue(self.p.queue_limit)
        self._active = False
        self._finalized = False  # the lifecycle `shutdown` transition ran: no way back
        self._stopping: Optional[str] = None  # why the process is shutting down (e.g. "SIGTERM received")
        self._lock = threading.Lock()  # guards the counters below
        self._in_flight = 0  # requests taken (service calls, accepted goals) and not yet answered
        self._counts = {"served": 0, "failed": 0, "rejected": 0, "queue_full": 0}
        self._reserved = {}  # id(goal message) -> (queue ticket, arrival): accepted goals not yet executing
        self._last_error: Optional[str] = None
        self._last_error_at = 0.0  # time.monotonic() of the last error
        self._failing = False  # the last request failed (WARN) until one succeeds or the node is re-activated
        self._configure_error: Optional[str] = None
        self._last_tau = 0.0
        self._last_ttft_s = 0.0
        self._prefix = (0, 0, 0)  # prefix cache: hits, misses (the session's running counts), last kept tokens
        self._memory_bytes = 0
        # One per response topic (edgespec_ros.pacing says why): plan, action_tokens, goal answers, results.
        self._pacers = {name: AnswerPacer(self.p.answer_interval_s) for name in ("plan", "action_tokens", "goal",
                                                                                  "result")}

        # The action's callbacks (its execution waits in the queue) apart from diagnostics, so both keep running.
        self._action_control_group = ReentrantCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()

        # Every request reaches a callback, to be queued or refused: see edgespec_ros.qos.
        self.service_node = services = create_request_node(self, "services")  # never added to an executor
        plan = services.create_service(Plan, request_name(self, "plan"), as_service_callback(self._answer_plan),
                                       qos_profile=REQUEST_QOS)
        actions = services.create_service(ActionTokens, request_name(self, "action_tokens"),
                                          as_service_callback(self._answer_action_tokens), qos_profile=REQUEST_QOS)
        # action requests first when both wait: a control loop's chunk is the more urgent
        self.service_handlers = [(actions, self._answer_action_tokens), (plan, self._answer_plan)]
        self.request_node = requests = create_request_node(self)
        self._action_server = ActionServer(
            requests, Generate, request_name(self, "generate", service=False), execute_callback=self._on_generate,
            goal_callback=self._on_goal, cancel_callback=lambda _goal: CancelResponse.ACCEPT,
            callback_group=self._action_control_group, result_timeout=RESULT_KEEP_S, **action_qos_kwargs())
        self._stats_pub = self.create_publisher(DecodeStatsMsg, "~/stats", 10)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(self.p.diagnostics_period_s, self._publish_diagnostics,
                                             callback_group=self._diagnostics_group)
        self.p.on_change("diagnostics_period_s", self._restart_diagnostics_timer)


# Seconds a finished goal's result stays with the action server for a client to fetch (rclcpp's default; rclpy's
# is 10 s): a client that fetched it later got an empty result with status UNKNOWN (the burst test's clients
# fetch results once every goal is answered, ~10 s into a crowded burst; 3 of 256 read as refusals with no field).
RESULT_KEEP_S = 900


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The executor thread
# that takes a request and the thread that generates share the GIL: with the default, a request arriving during
# a generation waited up to 5 ms before its callback ran (the p90 of the ROS/node overhead at 10 Hz).
GIL_SWITCH_INTERVAL_S = 0.0005


def main(args=None) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)  # our handler drains first
    return_large_blocks_on_free()  # cleanup gives the model memory back, whichever thread configured it
    received = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda num, _frame: received.append(signal.Signals(num).name))
    node = executor = request_spinner = service_loop = None
    try:
        node = EdgespecNode()
        executor = MultiThreadedExecutor(num_threads=4)  # lifecycle, parameters, diagnostics
        executor.add_node(node)
        # one thread per request waiting its turn (the queue's limit) plus a few for refusals, on each path
        service_loop = ServiceLoop(node.service_node, node.service_handlers, threads=node.queue.limit + 4).start()
        request_spinner = RequestSpinner(node.request_node, threads=node.queue.limit + 4).start()
        if node.p.autostart:
            if node.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                node.trigger_activate()
        while not received:
            executor.spin_once(timeout_sec=0.1)  # returns to Python often enough for the signal handler
        drain(executor, node, f"{received[0]} received")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except EdgespecError as exc:  # e.g. a parameter file with a bad value
        print(f"edgespec_node: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if service_loop is not None:
            service_loop.stop()
        if request_spinner is not None:
            request_spinner.stop()
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.service_node.destroy_node()
            node.request_node.destroy_node()
            node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
