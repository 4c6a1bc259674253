"""The node's services (~/plan, ~/action_tokens) served straight from one wait set, each request on the thread
that took it: no executor between a request's arrival and its callback.

Why: rclpy's executors take a request on the spinning thread, hand it to a worker thread and wake again to
rebuild their wait set; each step holds the GIL the request's own thread needs. Measured on the 2-vCPU test
machine, one trivial Plan service answered to an EventsExecutor client (p50 of 200 calls, quiet): this loop
0.92-0.94 ms, SingleThreadedExecutor 1.10, MultiThreadedExecutor 1.23-1.25.

How (a leader/follower pool): `threads` threads take turns as the leader, the one thread that waits on the
wait set. The leader takes one request, hands the leadership on (a lock released: the next thread starts
waiting while this one serves) and runs the service's handler, then sends its answer itself. So a request
waiting its turn in the node's queue holds one thread, as it did in the executor's pool, and refusals keep
being taken while a generation runs. The wait set is level-triggered: a second request that arrived with
the first is taken by the next leader at once.

    loop = ServiceLoop(node, [(plan_service, on_plan), (actions_service, on_actions)], threads=12).start()
    ...
    loop.stop()   # wakes the leader (a guard condition), joins the threads

A handler takes the request and returns (response, then): `then` (or None) runs after the answer is sent,
e.g. publishing ~/stats, so nothing the client does not need comes before its answer. A handler must not
raise (the node's never do); if one does, the request still gets a default response and the error is logged.
The services are the node's own rclpy Services; the node must not be added to an executor (it would take
the same requests).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.node import Node
from rclpy.service import Service

Handler = Callable[[Any], Tuple[Any, Optional[Callable[[], None]]]]


class ServiceLoop:
    def __init__(self, node: Node, services: Sequence[Tuple[Service, Handler]], threads: int):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._node = node
        self._services: List[Tuple[Service, Handler]] = list(services)  # taken in this order when both are ready
        self._context = node.context
        self._wake = _rclpy.GuardCondition(self._context.handle)
        self._leader = threading.Lock()
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, name=f"edgespec-service-{i}", daemon=True)
                         for i in range(threads)]

    def start(self) -> "ServiceLoop":
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking requests; a handler that is running finishes and sends its answer."""
        self._stopping = True
        with contextlib.suppress(Exception):
            self._wake.trigger_guard_condition()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=timeout_s)

    def _run(self) -> None:
        wait_set = None
        while not self._stopping:
            with self._leader:  # one thread waits; the others queue here to be the next leader
                if self._stopping:
                    return
                try:
                    if wait_set is None:
                        with self._context.handle:
                            wait_set = _rclpy.WaitSet(0, 1, 0, 0, len(self._services), 0, self._context.handle)
                    taken = self._take(wait_set)
                except Exception:  # the context or a service went away: the process is shutting down
                    self._stopping = True
                    with contextlib.suppress(Exception):
                        self._wake.trigger_guard_condition()  # the next leader must not wait forever
                    return
            if taken is not None:
                self._serve(*taken)

    def _take(self, wait_set) -> Optional[Tuple[Service, Handler, Any, Any]]:
        """Wait until a request is there (or stop() is called) and take it."""
        while not self._stopping:
            with contextlib.ExitStack() as held:
                held.enter_context(self._context.handle)
                for srv, _ in self._services:
                    held.enter_context(srv.handle)
                wait_set.clear_entities()
                for srv, _ in self._services:
                    wait_set.add_service(srv.handle)
                wait_set.add_guard_condition(self._wake)
                wait_set.wait(-1)  # releases the GIL
                if self._stopping:
                    return None
                for srv, handler in self._services:
                    request, header = srv.handle.service_take_request(srv.srv_type.Request)
                    if header is not None:
                        return srv, handler, request, header
        return None

    def _serve(self, srv: Service, handler: Handler, request, header) -> None:
        then = None
        try:
            response, then = handler(request)
        except Exception as exc:  # pragma: no cover - the node's handlers catch everything themselves
            self._node.get_logger().error(f"{srv.srv_name}: handler failed: {type(exc).__name__}: {exc}")
            response = srv.srv_type.Response()
        try:
            srv.send_response(response, header)
        except Exception as exc:  # the service was destroyed under it (shutdown): nobody to answer
            self._node.get_logger().warning(f"{srv.srv_name}: answer not sent: {type(exc).__name__}: {exc}")
        if then is not None:
            try:
                then()
            except Exception as exc:  # pragma: no cover
                self._node.get_logger().warning(f"{srv.srv_name}: after the answer: {type(exc).__name__}: {exc}")


def as_service_callback(handler: Handler) -> Callable[[Any, Any], Any]:
    """The rclpy service callback form of a handler (`create_service` needs one; an executor spinning the
    node would call it): the answer is returned, so what the handler left for later runs before it."""
    def callback(request, _response):
        response, then = handler(request)
        if then is not None:
            then()
        return response

    return callback
