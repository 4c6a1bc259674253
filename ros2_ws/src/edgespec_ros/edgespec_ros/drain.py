"""Process shutdown: SIGINT / SIGTERM drain the node (new requests refused, every request taken answered)
before it exits."""
from __future__ import annotations

import contextlib
import time


class DrainMixin:
    """In-flight tracking and shutdown of EdgespecNode."""

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


DRAIN_TIMEOUT_S = 30.0  # the longest a running request may take to stop after a signal
DRAIN_GRACE_S = 0.5  # spinning on after the last answer: action results reach waiting clients, late requests are refused


def drain(executor, node, reason: str) -> None:
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
