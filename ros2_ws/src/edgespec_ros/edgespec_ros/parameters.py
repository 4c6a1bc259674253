"""The node's parameters: declared with ranges and checks, read through a typed view.

Set them in a params file (configs/ros/edgespec.yaml, `/**: ros__parameters:`) or with `-p name:=value`.
A bad value in a params file stops the node at start-up with a message naming the parameter; a bad
value set at run time is refused with the same message. bundle/drafter/drafter.shape/backend/max_context
take effect at the next configure.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.exceptions import ParameterException

from runtime.errors import ConfigError
from runtime.serving.tuning import SHAPES

_NAME = re.compile(r"^[a-z0-9_]*$")


@dataclass(frozen=True)
class Spec:
    default: object
    doc: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    read_only: bool = False
    check: Optional[Callable[[object], Optional[str]]] = None  # returns why the value is wrong


def _name(v) -> Optional[str]:
    return None if _NAME.match(v) else "must be lower-case letters, digits and _ (empty = default)"


def _shape(v) -> Optional[str]:
    return None if v in SHAPES else f"must be one of {', '.join(SHAPES)} (as edgespec generate --shape)"


def _non_empty(v) -> Optional[str]:
    return None if v.strip() else "must not be empty"


SPECS: Dict[str, Spec] = {
    "bundle": Spec("build/bundles/zoo", "bundle directory; a relative path is taken from EDGESPEC_ROOT "
                   "(default: the working directory)", check=_non_empty),
    "drafter": Spec("", "drafter kind: draft_model, ngram, mtp, none, ... (empty = the bundle's default)",
                    check=_name),
    "drafter.shape": Spec("auto", "draft shape: fixed = the drafter's own every cycle; adaptive = each cycle's node "
                          "budget from the cost model and the acceptance so far; auto = adaptive where `edgespec "
                          "tune` measured this machine, else fixed", check=_shape),
    "backend": Spec("", "backend name (empty = the best available)", check=_name),
    "max_context": Spec(0, "context length in tokens (0 = the bundle's default)", 0, 1 << 20),
    "default_max_tokens": Spec(128, "max_tokens of a request that sends 0", 1, 1 << 16),
    "max_instruction_chars": Spec(8192, "longest instruction accepted (refused before any work, error_field "
                                  "instruction)", 1, 1 << 28),
    "max_context_chars": Spec(32768, "longest context / observation / observation_text accepted", 1, 1 << 28),
    "max_prompt_chars": Spec(65536, "longest Generate prompt accepted", 1, 1 << 28),
    "max_schema_chars": Spec(65536, "longest Plan schema accepted", 1, 1 << 28),
    "prioritise_actions": Spec(True, "serve action-token requests before queued plan/generate requests"),
    "queue_limit": Spec(16, "requests waiting or running at once; more are refused", 1, 256, read_only=True),
    "diagnostics_period_s": Spec(1.0, "period of /diagnostics", 0.05, 60.0),
    "feedback_period_s": Spec(0.03, "generate feedback is batched this often", 0.005, 1.0),
    "answer_interval_s": Spec(0.02, "least time between two answers of one service: a burst of fast refusals "
                              "paced so a default-QoS client (keep last 10) keeps its own (0 = unpaced; "
                              "edgespec_ros/pacing.py)", 0.0, 0.1,
                              read_only=True),
    "autostart": Spec(False, "configure and activate at start-up (no lifecycle manager needed)", read_only=True),
}


class Parameters:
    """Attribute view of the declared parameters (always the current values)."""

    def __init__(self, node):
        self._node = node
        self._hooks: Dict[str, List[Callable[[object], None]]] = {}

    def __getattr__(self, name: str):
        if name not in SPECS:
            raise AttributeError(name)
        return self._node.get_parameter(name).value

    def value(self, name: str):
        """A parameter whose name is no attribute (drafter.shape)."""
        return self._node.get_parameter(name).value

    def bundle_path(self) -> str:
        root = os.environ.get("EDGESPEC_ROOT") or os.getcwd()
        return os.path.normpath(os.path.join(root, os.path.expanduser(self.bundle)))

    def on_change(self, name: str, hook: Callable[[object], None]) -> None:
        self._hooks.setdefault(name, []).append(hook)

    def _run_hooks(self, params) -> None:
        for p in params:
            for hook in self._hooks.get(p.name, []):
                hook(p.value)


def _descriptor(name: str, spec: Spec) -> ParameterDescriptor:
    d = ParameterDescriptor(description=spec.doc, read_only=spec.read_only)
    if spec.lo is not None and isinstance(spec.default, int) and not isinstance(spec.default, bool):
        d.integer_range = [IntegerRange(from_value=int(spec.lo), to_value=int(spec.hi), step=1)]
    elif spec.lo is not None:
        d.floating_point_range = [FloatingPointRange(from_value=float(spec.lo), to_value=float(spec.hi), step=0.0)]
    return d


def _validate(params) -> SetParametersResult:
    for p in params:
        spec = SPECS.get(p.name)
        why = spec.check(p.value) if spec and spec.check and isinstance(p.value, str) else None
        if why:
            return SetParametersResult(successful=False, reason=f"parameter {p.name}={p.value!r}: {why}")
    return SetParametersResult(successful=True)


def declare_parameters(node) -> Parameters:
    """Declare every parameter in SPECS on `node`; raises ConfigError for a bad value at start-up."""
    view = Parameters(node)

    def on_set(params) -> SetParametersResult:
        result = _validate(params)
        if result.successful:
            view._run_hooks(params)  # hooks only on a run-time change: declaration happens before them
        return result

    node.add_on_set_parameters_callback(on_set)
    for name, spec in SPECS.items():
        try:
            node.declare_parameter(name, spec.default, _descriptor(name, spec))
        except (ParameterException, TypeError, ValueError) as exc:
            raise ConfigError(f"parameter {name}: {exc} (expected: {spec.doc}; default {spec.default!r})") from exc
    return view
