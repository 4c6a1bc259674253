"""The node's lifecycle: configure opens the Session, activate / deactivate start and stop serving, cleanup
and shutdown free the model; and what state the node is in, as the client is told it."""
from __future__ import annotations

import traceback
from typing import Optional

from rclpy.lifecycle import State, TransitionCallbackReturn

from runtime.errors import EdgespecError
from runtime.serving.session import Session


class LifecycleMixin:
    """Lifecycle callbacks of EdgespecNode (edgespec_ros.node holds the state they read and write)."""

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
