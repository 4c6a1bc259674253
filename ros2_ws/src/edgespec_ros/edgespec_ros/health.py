"""The node's health: request counters, the last error, and the /diagnostics status built from them."""
from __future__ import annotations

import time
from typing import Callable, List, Optional

from edgespec_ros import messages


class HealthMixin:
    """Bookkeeping and diagnostics of EdgespecNode."""

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _finished(self, stats, later: Optional[List[Callable[[], None]]] = None) -> None:
        """Count a served request; its stats go to ~/stats now, or via `later` once the answer is sent."""
        with self._lock:
            self._counts["served"] += 1
            self._failing = False
            self._last_tau = float(stats.tau)
            self._last_ttft_s = float(stats.ttft_s)
            self._prefix = (int(stats.prefix_hits), int(stats.prefix_misses), int(stats.prefix_tokens))
            self._memory_bytes = int(stats.memory_bytes) or self._memory_bytes
        publish = lambda: self._stats_pub.publish(messages.stats_msg(stats))  # noqa: E731
        if later is None:
            publish()
        else:
            later.append(publish)

    def _failed(self, message: str) -> None:
        with self._lock:
            self._counts["failed"] += 1
            self._last_error = message.splitlines()[0]
            self._last_error_at = time.monotonic()
            self._failing = True
        self.get_logger().error(message)

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
