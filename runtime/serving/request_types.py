"""What a request asks and what it gets back: the sampling and limits of one request (`GenerationParams`, checked
before any work starts) and the results of free generation, a plan and an action chunk."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from runtime.decode.engine import DecodeStats
from runtime.errors import RequestError
from runtime.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    deadline_s: Optional[float] = None  # seconds from the start of the request
    stop: Sequence[str] = ()

    def sampling(self, allowed_tokens=None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, allowed_tokens=allowed_tokens)

    def check(self) -> None:
        if self.deadline_s is not None and (not isinstance(self.deadline_s, (int, float)) or math.isnan(self.deadline_s)
                                            or self.deadline_s <= 0):
            raise RequestError("deadline_s", f"must be a number of seconds > 0 (or None), got {self.deadline_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise RequestError("seed", f"must be an integer >= 0, got {self.seed!r}")


@dataclass
class Partial:
    """What a request had decoded when it failed, set as `exc.partial` on the exception: exactly the text
    passed to on_delta so far (a streaming caller returns it with the error) and its token ids."""
    text: str
    token_ids: List[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    stats: DecodeStats


@dataclass
class PlanResult:
    text: str
    plan: Optional[list]
    plan_ok: bool
    plan_error: str
    objects: List[str]
    finish_reason: str
    stats: DecodeStats


@dataclass
class ActionResult:
    token_ids: List[int]
    actions: np.ndarray  # (num_actions, dims) float32
    dims: int
    finish_reason: str
    stats: DecodeStats
