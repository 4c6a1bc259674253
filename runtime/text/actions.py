"""Action tokens (RT-2 / OpenVLA style): each action dimension is discretised into 256 uniform bins over its
range, and every bin is one dedicated token `<|aNNN|>` shared by all dimensions.

Worked example (dims=2, bins=4, ranges [-1, 1] and [0, 1], bin tokens with ids 10..13):
    encode([[-1.0, 0.9]]) -> bins [0, 3] -> ids [10, 13]
    decode([10, 13])      -> bin centres [[-0.75, 0.875]]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from runtime.errors import RequestError
from runtime.text.prompts import ACTION_BINS, ACTION_DIMS, ACTION_TOKENS

# Per-dimension ranges of the zoo's simulated arm: dx dy dz (m), droll dpitch dyaw (rad), gripper opening (0..1).
DEFAULT_LOW = (-0.05, -0.05, -0.05, -0.2, -0.2, -0.2, 0.0)
DEFAULT_HIGH = (0.05, 0.05, 0.05, 0.2, 0.2, 0.2, 1.0)


def has_action_tokens(tokenizer) -> bool:
    """Whether the tokenizer has every action-bin token (a model trained to emit actions, like the zoo's)."""
    return all(tokenizer.token_to_id(tok) is not None for tok in ACTION_TOKENS)


def no_action_tokens(missing) -> str:
    """Why a model without (all) the bin tokens cannot answer action requests, and what one needs."""
    which = "none of" if len(missing) == len(ACTION_TOKENS) else f"not all ({len(missing)} missing, e.g. {missing[0]}) of"
    return (f"this model has no action tokens: its tokenizer has {which} the {ACTION_BINS} bin tokens "
            f"{ACTION_TOKENS[0]} .. {ACTION_TOKENS[-1]}. Action requests need a model whose tokenizer has them and "
            "that was trained to emit them (the zoo target, `edgespec zoo build`); ask this one planner or text "
            "requests")


@dataclass(frozen=True)
class ActionTokenizer:
    token_ids: tuple  # (bins,) vocabulary id of bin b's token
    low: tuple = DEFAULT_LOW  # (dims,)
    high: tuple = DEFAULT_HIGH  # (dims,)
    dims: int = ACTION_DIMS
    bins: int = ACTION_BINS
    _lookup: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if len(self.token_ids) != self.bins:
            raise RequestError("token_ids", f"has {len(self.token_ids)} ids, expected one per bin ({self.bins})")
        if len(self.low) != self.dims or len(self.high) != self.dims:
            raise RequestError("low/high", f"need {self.dims} values each")
        if any(h <= l for l, h in zip(self.low, self.high)):
            raise RequestError("low/high", "every high must exceed its low")
        object.__setattr__(self, "_lookup", {int(t): b for b, t in enumerate(self.token_ids)})

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> "ActionTokenizer":
        """Look the bin tokens up by string in a `tokenizers.Tokenizer` (or anything with token_to_id)."""
        missing = [tok for tok in ACTION_TOKENS if tokenizer.token_to_id(tok) is None]
        if missing:
            raise RequestError("tokenizer", no_action_tokens(missing))
        return cls(token_ids=tuple(int(tokenizer.token_to_id(tok)) for tok in ACTION_TOKENS), **kwargs)

    def _arrays(self):
        low = np.asarray(self.low, dtype=np.float64)
        high = np.asarray(self.high, dtype=np.float64)
        return low, high, (high - low) / self.bins

    def encode(self, actions) -> np.ndarray:
        """actions (N, dims) float -> token ids (N*dims,) int64, row-major; values outside the range clip."""
        a = np.asarray(actions, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != self.dims:
            raise RequestError("actions", f"must have shape (N, {self.dims}), got {a.shape}")
        low, high, width = self._arrays()
        b = np.floor((np.clip(a, low, high) - low) / width).astype(np.int64)
        b = np.clip(b, 0, self.bins - 1)
        return np.asarray(self.token_ids, dtype=np.int64)[b.reshape(-1)]

    def decode(self, token_ids: Sequence[int]) -> np.ndarray:
        """token ids (N*dims,) -> actions (N, dims) float32 at bin centres."""
        ids = [int(t) for t in token_ids]
        if len(ids) % self.dims:
            raise RequestError("action_tokens", f"{len(ids)} tokens is not a multiple of {self.dims} dims")
        try:
            b = np.array([self._lookup[t] for t in ids], dtype=np.float64)
        except KeyError as exc:
            raise RequestError("action_tokens", f"token id {exc.args[0]} is not an action-bin token") from None
        low, _, width = self._arrays()
        a = low + (b.reshape(-1, self.dims) + 0.5) * width
        return a.astype(np.float32)

    def allowed_token_ids(self) -> np.ndarray:
        """The ids the target may emit inside an action chunk (the mask that restricts sampling)."""
        return np.asarray(sorted(self.token_ids), dtype=np.int64)

    def is_action_token(self, token_id: int) -> bool:
        return int(token_id) in self._lookup
