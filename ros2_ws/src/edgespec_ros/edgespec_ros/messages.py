"""Runtime results -> ROS messages, and the diagnostics status. Field copying only: no model logic."""
from __future__ import annotations

import math
from typing import Dict, Optional

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from edgespec_interfaces.msg import DecodeStats as DecodeStatsMsg

UINT32_MAX = 2**32 - 1


def _f32(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else 0.0


def stats_msg(stats, queue_s: float = 0.0, drafter: str = "", backend: str = "") -> DecodeStatsMsg:
    """A runtime DecodeStats (or None, for a request that never generated) as a message."""
    msg = DecodeStatsMsg()
    msg.queue_s = _f32(queue_s)
    msg.drafter = drafter
    msg.backend = backend
    if stats is None:
        return msg
    msg.tokens = min(int(stats.tokens), UINT32_MAX)
    msg.target_forwards = min(int(stats.target_forwards), UINT32_MAX)
    msg.cycles = min(int(stats.cycles), UINT32_MAX)
    msg.tau = _f32(stats.tau)
    msg.acceptance_by_depth = [_f32(a) for a in stats.acceptance_by_depth]
    msg.tokens_per_s = _f32(stats.tokens_per_s)
    msg.ttft_s = _f32(stats.ttft_s)
    msg.prefill_s = _f32(stats.prefill_s)
    msg.draft_s = _f32(stats.draft_s)
    msg.verify_s = _f32(stats.verify_s)
    msg.other_s = _f32(stats.other_s)
    msg.grammar_s = _f32(getattr(stats, "grammar_s", 0.0))
    msg.wall_s = _f32(stats.wall_s)
    msg.memory_bytes = max(0, int(stats.memory_bytes))
    msg.drafter = stats.drafter or drafter
    msg.backend = stats.backend or backend
    return msg


def fill_plan(resp, res) -> None:
    resp.text = res.text
    resp.plan_ok = bool(res.plan_ok)
    resp.plan_error = res.plan_error or ""
    resp.finish_reason = res.finish_reason


def fill_action_tokens(resp, res) -> None:
    actions = res.actions.reshape(-1, int(res.dims)) if res.dims else res.actions.reshape(0, 0)
    resp.token_ids = [int(t) for t in res.token_ids]
    resp.actions = [float(a) for a in actions.reshape(-1)]
    resp.num_actions = int(actions.shape[0])
    resp.action_dims = int(res.dims)
    resp.finish_reason = res.finish_reason


def fill_generate(result, res) -> None:
    result.text = res.text
    result.token_ids = [int(t) for t in res.token_ids]
    result.finish_reason = res.finish_reason


def fill_partial(resp, partial) -> None:
    """A request that failed mid-generation keeps what it had decoded (runtime.serving.session.Partial)."""
    if partial is None:
        return
    if hasattr(resp, "text"):
        resp.text = partial.text
    if hasattr(resp, "token_ids"):
        resp.token_ids = [int(t) for t in partial.token_ids]
    resp.finish_reason = "error"


def diagnostic_array(stamp, name: str, hardware_id: str, level: str, message: str,
                     values: Dict[str, object]) -> DiagnosticArray:
    """One DiagnosticStatus in an array, as diagnostic_updater would publish it (which is not on PyPI)."""
    status = DiagnosticStatus()
    status.level = {"ok": DiagnosticStatus.OK, "warn": DiagnosticStatus.WARN,
                    "error": DiagnosticStatus.ERROR}[level]
    status.name = name
    status.hardware_id = hardware_id
    status.message = message
    status.values = [KeyValue(key=k, value=_text(v)) for k, v in values.items()]
    array = DiagnosticArray()
    array.header.stamp = stamp
    array.status = [status]
    return array


def _text(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def request_level(state: str, failing: bool, configure_error: Optional[str]) -> str:
    """ERROR: configure failed; WARN: not serving, or the last request failed; OK otherwise."""
    if configure_error:
        return "error"
    if state != "active" or failing:
        return "warn"
    return "ok"
