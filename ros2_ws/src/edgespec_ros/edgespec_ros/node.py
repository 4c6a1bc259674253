"""The edgespec lifecycle node: thin glue between ROS 2 and `runtime.serving.session.Session`.

    configure  -> Session.open(bundle, drafter, backend, max_context)   (parameters, e.g. configs/ros/edgespec.yaml)
    activate   -> serve ~/plan, ~/action_tokens (services) and ~/generate (action)
    deactivate -> stop serving: queued requests fail, a running generation is cancelled
    cleanup    -> Session.close() frees the model memory
    shutdown   -> finalized: requests are refused until the process restarts
    SIGINT/SIGTERM -> drain: refuse new requests, answer the queued ones, stop the running one, exit 0

Requests are served one at a time (batch 1) from a RequestQueue; the service callbacks and the
action's execution wait there in their own (reentrant) callback group while the diagnostics timer,
the lifecycle services and cancel requests run in other groups of a MultiThreadedExecutor.
Uses only rclpy API common to Humble, Jazzy and Kilted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from edgespec_interfaces.action import Generate
from edgespec_interfaces.msg import DecodeStats as DecodeStatsMsg
from edgespec_interfaces.srv import ActionTokens, Plan
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions

from edgespec_ros import messages
from edgespec_ros.pacing import AnswerPacer
from edgespec_ros.parameters import declare_parameters
from edgespec_ros.qos import REQUEST_QOS, action_qos_kwargs
from edgespec_ros.request_queue import PRIORITY_ACTIONS, PRIORITY_NORMAL, GaveUp, QueueFull, RequestQueue
from runtime.errors import EdgespecError, RequestError
from runtime.serving.limits import LIMIT_OF, RequestLimits
from runtime.serving.session import GenerationParams, Session, return_large_blocks_on_free


class EdgespecNode(LifecycleNode):
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

        # Generation waits and runs here; everything else lives in other groups so it keeps running.
        self.generation_group = ReentrantCallbackGroup()
        self._action_control_group = ReentrantCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()

        # Every request reaches a callback, to be queued or refused: see edgespec_ros.qos.
        self.create_service(Plan, "~/plan", self._on_plan, qos_profile=REQUEST_QOS,
                            callback_group=self.generation_group)
        self.create_service(ActionTokens, "~/action_tokens", self._on_action_tokens, qos_profile=REQUEST_QOS,
                            callback_group=self.generation_group)
        self._action_server = ActionServer(
            self, Generate, "~/generate", execute_callback=self._on_generate,
            goal_callback=self._on_goal, cancel_callback=lambda _goal: CancelResponse.ACCEPT,
            callback_group=self._action_control_group, **action_qos_kwargs())
        self._stats_pub = self.create_publisher(DecodeStatsMsg, "~/stats", 10)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(self.p.diagnostics_period_s, self._publish_diagnostics,
                                             callback_group=self._diagnostics_group)
        self.p.on_change("diagnostics_period_s", self._restart_diagnostics_timer)

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        p = self.p
        shape = p.value("drafter.shape")
        self.get_logger().info(f"configure: opening bundle {p.bundle_path()} (drafter={p.drafter or 'default'}, "
                               f"shape={shape}, backend={p.backend or 'auto'}, "
                               f"max_context={p.max_context or 'default'})")
        self._configure_error = None  # this attempt's reason, not the previous bundle's
        step = "opening the bundle"
        try:
            self.session = Session.open(p.bundle_path(), drafter=p.drafter or None, backend=p.backend or None,
                                        max_context=p.max_context or None, shape=shape)
            step = "the warm-up request (configured drafter and backend)"
            self.session.warm_up()
        except Exception as exc:  # whatever it is (a PermissionError on a data file, an ONNX Runtime type error)
            return self._configure_failed(step, exc)
        self._memory_bytes = self.session.memory_in_use()
        self.get_logger().info(f"configured: drafter={self.session.drafter_kind} shape={self.session.shape.label} "
                               f"backend={self.session.backend_name} "
                               f"memory={self._memory_bytes / 2**20:.1f} MiB")
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self, step: str, exc: Exception) -> TransitionCallbackReturn:
        """Log the reason, put it on /diagnostics (ERROR) and stay unconfigured; a bug gets its traceback."""
        where = "" if step == "opening the bundle" else f"{step} failed: "
        self._configure_error = f"{where}{type(exc).__name__}: {exc}"
        trace = "" if isinstance(exc, EdgespecError) else "\n" + traceback.format_exc()
        self.get_logger().error(f"configure failed: {self._configure_error}{trace}")
        if self.session is not None:
            self._close_session()
        return TransitionCallbackReturn.FAILURE

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self._active = True
        self._failing = False  # an operator re-activated the node: a new start, the old error stays on record
        self.get_logger().info("active: serving requests")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False  # waiters give up, a running generate() sees should_stop()
        self.get_logger().info("inactive: not serving")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self._close_session()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self._finalized = True
        self._close_session()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self._close_session()
        return TransitionCallbackReturn.SUCCESS

    def _close_session(self) -> None:
        if not self.queue.wait_idle(timeout_s=30.0):
            self.get_logger().warning("cleanup: a generation is still running after 30 s; closing anyway")
        if self.session is not None:
            self.session.close()
            self.session = None
            self._memory_bytes = 0
            self.get_logger().info("cleaned up: model memory released")

    # ---- requests --------------------------------------------------------------------------------
    def _on_plan(self, req: Plan.Request, resp: Plan.Response) -> Plan.Response:
        with self._tracked():
            resp = self._plan(req, resp)
            self._pacers["plan"].wait()
            return resp

    def _plan(self, req: Plan.Request, resp: Plan.Response) -> Plan.Response:
        def run(session: Session, params: GenerationParams, _stop):
            return session.plan(req.instruction, context=req.context, observation=req.observation, params=params,
                                schema=req.schema or None)

        return self._serve("plan", req, resp, PRIORITY_NORMAL, run, messages.fill_plan)

    def _on_action_tokens(self, req: ActionTokens.Request, resp: ActionTokens.Response) -> ActionTokens.Response:
        with self._tracked():
            resp = self._action_tokens(req, resp)
            self._pacers["action_tokens"].wait()
            return resp

    def _action_tokens(self, req: ActionTokens.Request, resp: ActionTokens.Response) -> ActionTokens.Response:
        def run(session: Session, params: GenerationParams, _stop):
            chunk = {"num_actions": int(req.num_actions)} if req.num_actions else {}  # 0: the runtime's default
            return session.action_tokens(req.instruction, observation=list(req.observation),
                                         observation_text=req.observation_text, params=params, **chunk)

        priority = PRIORITY_ACTIONS if self.p.prioritise_actions else PRIORITY_NORMAL
        return self._serve("action_tokens", req, resp, priority, run, messages.fill_action_tokens)

    def _on_goal(self, goal: Generate.Goal) -> GoalResponse:
        """Accept a goal only with its place in the queue taken: a goal accepted on a free slot that another
        request took before it executed was aborted with `queue` (1-4 per burst)."""
        received = time.monotonic()
        reason = self._not_serving()
        if reason is None:
            try:
                ticket = self.queue.join(PRIORITY_NORMAL)
            except QueueFull:
                reason = f"queue full ({self.queue.limit})"
        if reason:
            self._count("rejected")
            self.get_logger().warning(f"generate goal rejected: {reason}")
            self._pacers["goal"].wait()
            return GoalResponse.REJECT
        with self._lock:
            self._reserved[id(goal)] = (ticket, received)  # goal_handle.request is this same message
        self._track(+1)  # until _on_generate has answered it
        self._pacers["goal"].wait()
        return GoalResponse.ACCEPT

    def _on_generate(self, goal_handle) -> Generate.Result:
        try:
            result = self._generate(goal_handle)
            self._pacers["result"].wait()
            return result
        finally:
            self._track(-1)

    def _generate(self, goal_handle) -> Generate.Result:
        goal: Generate.Goal = goal_handle.request
        with self._lock:
            ticket, received = self._reserved.pop(id(goal), (None, None))
        feedback = _FeedbackBatcher(goal_handle.publish_feedback, self.p.feedback_period_s)

        def run(session: Session, params: GenerationParams, stop: Callable[[], bool]):
            try:
                return session.generate(goal.prompt, params, on_delta=feedback.add, should_stop=stop)
            finally:
                feedback.flush()

        result = self._serve("generate", goal, Generate.Result(), PRIORITY_NORMAL, run, messages.fill_generate,
                             prompt_field="prompt", cancelled=lambda: goal_handle.is_cancel_requested,
                             ticket=ticket, received=received)
        if result.finish_reason == "cancelled" and not goal_handle.is_cancel_requested:
            result.success, result.error_field = False, "state"  # stopped by the node, not by the client
            result.message = f"{self._not_serving() or 'node stopped serving'}; partial text returned"
        if goal_handle.is_cancel_requested and result.finish_reason == "cancelled":
            goal_handle.canceled()
        elif result.success:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        return result

    def _serve(self, kind: str, req, resp, priority: int, run, fill, prompt_field: str = "instruction",
               cancelled: Callable[[], bool] = lambda: False, ticket=None, received: Optional[float] = None):
        """Check, queue, generate, answer. Every outcome lands in `resp`; nothing escapes to rclpy. `ticket`:
        the queue place taken when the goal was accepted; `received`: when the request arrived (queue_s counts
        from there, the checks included)."""
        received = received if received is not None else time.monotonic()
        try:
            params = self._params(req, prompt_field)
            why = self._not_serving()
            if why:
                raise RequestError("state", why)
            if ticket is None:
                try:
                    ticket = self.queue.join(priority)
                except QueueFull as exc:
                    raise RequestError("queue", str(exc)) from None
            deadline = received + req.deadline_s if req.deadline_s > 0 else None

            def give_up() -> Optional[str]:
                if cancelled():
                    return "cancelled"
                why = self._not_serving()
                if why:
                    return f"{why} (the request was still queued)"
                if deadline is not None and time.monotonic() >= deadline:
                    return "deadline"
                return None

            try:
                self.queue.wait_turn(ticket, give_up)
            except GaveUp as exc:
                if str(exc) in ("deadline", "cancelled"):
                    return self._unserved(resp, str(exc), time.monotonic() - received)
                raise RequestError("state", str(exc)) from None
            session, why = self.session, self._not_serving()
            if why or session is None:
                raise RequestError("state", f"{why or 'node has no model'} (the request was still queued)")
            if deadline is not None:
                params = dataclasses.replace(params, deadline_s=max(deadline - time.monotonic(), 1e-3))
            res = run(session, params, lambda: cancelled() or self._not_serving() is not None)
            fill(resp, res)
            resp.success = True
            resp.stats = messages.stats_msg(res.stats, ticket.started_at - received)
            self._finished(res.stats)
        except RequestError as exc:
            resp.success, resp.error_field, resp.message = False, exc.field, str(exc)
            self._count("queue_full" if exc.field == "queue" else "failed")  # a full queue is load, not a failure
            self.get_logger().warning(f"{kind}: refused: {exc}")
        except EdgespecError as exc:
            resp.success, resp.message = False, f"{type(exc).__name__}: {exc}"
            messages.fill_partial(resp, getattr(exc, "partial", None))
            self._failed(f"{kind}: {resp.message}")
        except Exception as exc:  # a bug must fail one request, not the node
            resp.success, resp.message = False, f"internal error: {type(exc).__name__}: {exc}"
            messages.fill_partial(resp, getattr(exc, "partial", None))
            self._failed(f"{kind}: {resp.message}\n{traceback.format_exc()}")
        finally:
            if ticket is not None:
                self.queue.leave(ticket)
        return resp

    def _params(self, req, prompt_field: str) -> GenerationParams:
        """Cheap checks answered before queueing; the runtime checks the rest (prompt length, budget, ...).
        The sizes come first: nothing else may look at a text before its length is known to be bounded."""
        p = self.p
        limits = RequestLimits(p.max_instruction_chars, p.max_context_chars, p.max_prompt_chars, p.max_schema_chars)
        limits.check({name: getattr(req, name) for name in LIMIT_OF if isinstance(getattr(req, name, None), str)})
        if not getattr(req, prompt_field).strip():
            raise RequestError(prompt_field, "is empty: send the instruction text")
        if not math.isfinite(req.temperature) or req.temperature < 0:
            raise RequestError("temperature", f"must be a finite number >= 0, got {req.temperature}")
        if not math.isfinite(req.deadline_s) or req.deadline_s < 0:
            raise RequestError("deadline_s", f"must be >= 0 seconds (0 = none), got {req.deadline_s}")
        kwargs = dict(max_tokens=getattr(req, "max_tokens", 0) or self.p.default_max_tokens,
                      temperature=float(req.temperature), seed=int(req.seed))
        top_p = float(getattr(req, "top_p", 0.0))
        if not 0.0 <= top_p <= 1.0:  # NaN fails too; 0 means off (the message's default)
            raise RequestError("top_p", f"must be in [0, 1] (0 = off), got {top_p}")
        if top_p > 0:
            kwargs["top_p"] = top_p
        if getattr(req, "top_k", 0) > 0:
            kwargs["top_k"] = int(req.top_k)
        return GenerationParams(**kwargs)

    def _unserved(self, resp, reason: str, waited_s: float):
        """A request whose deadline passed (or that was cancelled) while queued: it has nothing yet."""
        resp.success = True
        resp.finish_reason = reason
        resp.message = f"{reason} while queued (waited {waited_s:.3f} s); nothing generated"
        session = self.session
        resp.stats = messages.stats_msg(None, waited_s, session.drafter_kind if session else "",
                                        session.backend_name if session else "")
        self._count("served")
        return resp

    # ---- bookkeeping and diagnostics -------------------------------------------------------------
    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _finished(self, stats) -> None:
        with self._lock:
            self._counts["served"] += 1
            self._failing = False
            self._last_tau = float(stats.tau)
            self._last_ttft_s = float(stats.ttft_s)
            self._prefix = (int(stats.prefix_hits), int(stats.prefix_misses), int(stats.prefix_tokens))
            self._memory_bytes = int(stats.memory_bytes) or self._memory_bytes
        self._stats_pub.publish(messages.stats_msg(stats))

    def _failed(self, message: str) -> None:
        with self._lock:
            self._counts["failed"] += 1
            self._last_error = message.splitlines()[0]
            self._last_error_at = time.monotonic()
            self._failing = True
        self.get_logger().error(message)

    def _state_label(self) -> str:
        if self._stopping:
            return "shutting down"
        if self._finalized:
            return "finalized"
        if self._active:
            return "active"
        return "inactive" if self.session is not None else "unconfigured"

    def _not_serving(self) -> Optional[str]:
        """Why a request cannot be served now, for the client (None when the node serves)."""
        if self._stopping:
            return (f"node is shutting down ({self._stopping}): it accepts no more requests; "
                    "send them to another node or after it restarts")
        if self._finalized:
            return "node is finalized (lifecycle transition 'shutdown' ran): it cannot serve again; restart it"
        if self._active and self.session is not None:
            return None
        if self.session is not None:
            return "node is inactive, not active: activate it first (lifecycle transition 'activate')"
        return ("node is unconfigured, not active: configure and activate it first "
                "(lifecycle transitions 'configure', 'activate')")

    # ---- process shutdown ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _tracked(self):
        self._track(+1)
        try:
            yield
        finally:
            self._track(-1)

    def _track(self, delta: int) -> None:
        with self._lock:
            self._in_flight += delta

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def begin_shutdown(self, reason: str) -> None:
        """Stop accepting: new requests are refused, queued ones give up, a running generation stops."""
        self._stopping = reason
        self.get_logger().info(f"shutting down ({reason}): refusing new requests, answering "
                               f"{len(self.queue)} queued or running")

    def close(self) -> None:
        self._active = False
        self._close_session()

    def _publish_diagnostics(self) -> None:
        session = self.session
        state = self._state_label()
        with self._lock:
            counts, last_error, tau = dict(self._counts), self._last_error, self._last_tau
            ttft_s, (prefix_hits, prefix_misses, prefix_tokens) = self._last_ttft_s, self._prefix
            failing, error_age_s = self._failing, time.monotonic() - self._last_error_at
        message = self._configure_error or state
        if failing and not self._configure_error:
            message = f"{state}; the last request failed {error_age_s:.1f} s ago: {last_error}"
        changed = session.changed_files() if session is not None else []
        if changed and not failing:
            message = (f"{state}; the bundle changed on disk since configure: {', '.join(changed)}; serving the "
                       "model loaded then: reconfigure (cleanup, configure) to load the new files")
        values = {
            "state": state,
            "bundle": self.p.bundle_path(),
            "backend": session.backend_name if session else self.p.backend,
            "drafter": session.drafter_kind if session else self.p.drafter,
            "memory_bytes": self._memory_bytes,
            "tau_last": tau,
            "ttft_last_s": ttft_s,
            "prefix_cache_hits": prefix_hits,  # requests that kept K/V rows of the previous request's prefix
            "prefix_cache_misses": prefix_misses,
            "prefix_cache_tokens_last": prefix_tokens,
            "queue_length": len(self.queue),
            "queue_limit": self.queue.limit,
            "busy": self.queue.busy,
            "requests_served": counts["served"],
            "requests_failed": counts["failed"],
            "goals_rejected": counts["rejected"],
            "requests_refused_queue_full": counts["queue_full"],  # load, not failures: not in requests_failed
            "last_error": last_error or "",  # kept after a success, with its age; WARN only while failing
            "last_error_age_s": error_age_s if last_error else "",
            "configure_error": self._configure_error or "",
            "bundle_changed": ", ".join(changed),
        }
        level = messages.request_level(state, failing or bool(changed), self._configure_error)
        self._diag_pub.publish(messages.diagnostic_array(
            self.get_clock().now().to_msg(), f"edgespec: {self.get_fully_qualified_name()}",
            values["backend"] or "edgespec", level, message, values))

    def _restart_diagnostics_timer(self, period_s: float) -> None:
        self.destroy_timer(self._diag_timer)
        self._diag_timer = self.create_timer(period_s, self._publish_diagnostics,
                                             callback_group=self._diagnostics_group)


class _FeedbackBatcher:
    """Turns per-token deltas into feedback every `period_s` (per-token feedback gets dropped under load)."""

    def __init__(self, publish, period_s: float):
        self._publish, self._period_s = publish, period_s
        self._pending: list = []
        self._tokens = 0
        self._seq = 0
        self._last = time.monotonic()

    def add(self, text_delta: str, total_tokens: int) -> None:
        self._pending.append(text_delta)
        self._tokens = total_tokens
        if time.monotonic() - self._last >= self._period_s:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        msg = Generate.Feedback(text_delta="".join(self._pending), tokens=self._tokens, seq=self._seq)
        self._pending, self._seq, self._last = [], self._seq + 1, time.monotonic()
        self._publish(msg)


DRAIN_TIMEOUT_S = 30.0  # the longest a running request may take to stop after a signal
DRAIN_GRACE_S = 0.5  # spinning on after the last answer: action results reach waiting clients, late requests are refused


def _drain(executor, node: EdgespecNode, reason: str) -> None:
    """Answer everything taken before the process goes: rclpy's own signal handler would shut the
    context down under the running callbacks (requests unanswered, InvalidHandle tracebacks)."""
    node.begin_shutdown(reason)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while node.in_flight() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    grace_end = time.monotonic() + DRAIN_GRACE_S
    while time.monotonic() < grace_end:
        executor.spin_once(timeout_sec=0.05)
    if node.in_flight():
        node.get_logger().warning(f"shutdown: {node.in_flight()} requests still running after {DRAIN_TIMEOUT_S} s")
    node.close()
    node.get_logger().info("shut down: every request taken was answered")


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
    node = executor = None
    try:
        node = EdgespecNode()
        executor = MultiThreadedExecutor(num_threads=node.queue.limit + 4)  # one per waiting request + control
        executor.add_node(node)
        if node.p.autostart:
            if node.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                node.trigger_activate()
        while not received:
            executor.spin_once(timeout_sec=0.1)  # returns to Python often enough for the signal handler
        _drain(executor, node, f"{received[0]} received")
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except EdgespecError as exc:  # e.g. a parameter file with a bad value
        print(f"edgespec_node: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if executor is not None:
            executor.shutdown()
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
