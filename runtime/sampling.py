"""Sampling parameters and the logits -> probabilities transform shared by the target and every drafter.

Speculative decoding is exact with respect to the PROCESSED target distribution, so the same
`process_logits` must turn the target's logits into p and the drafter's logits into q. The order is fixed:

    allowed mask & grammar mask -> repetition penalty -> greedy one-hot | temperature -> top-k -> top-p -> min-p
    -> renormalise

The grammar mask (runtime/text/grammar.py) differs per row (each verify row has its own path), so it is passed
per call, not in SamplingParams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from runtime.errors import RequestError

# Cumulative-mass comparisons in top-p tolerate this much float round-off, so that
# p = (0.5, 0.3, 0.2) with top_p = 0.8 keeps exactly {0, 1} however the softmax rounded.
_TOP_P_TOLERANCE = 1e-9


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    min_p: float = 0.0  # in [0, 1); 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    allowed_tokens: Optional[Tuple[int, ...]] = None  # restrict to these ids (e.g. action tokens); None = all

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError naming the first bad field; return None when every field is usable."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise RequestError("temperature", f"must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise RequestError("top_k", f"must be an integer >= 0 (0 = off), got {k!r}")
        tp = self.top_p
        if not _is_real(tp) or not (0.0 < tp <= 1.0):
            raise RequestError("top_p", f"must be in (0, 1] (1 = off), got {tp!r}")
        mp = self.min_p
        if not _is_real(mp) or not (0.0 <= mp < 1.0):
            raise RequestError("min_p", f"must be in [0, 1) (0 = off), got {mp!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise RequestError("repetition_penalty", f"must be a finite number > 0 (1 = off), got {rp!r}")
        if self.allowed_tokens is not None:
            ids = tuple(self.allowed_tokens)
            if not ids:
                raise RequestError("allowed_tokens", "must name at least one token id, or be None for all")
            bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))
                   or not (0 <= i < vocab_size)]
            if bad:
                raise RequestError(
                    "allowed_tokens", f"ids must be integers in [0, {vocab_size}), got {bad[:5]!r}")


def _is_real(x: object) -> bool:
    """True for int/float values that are not NaN and not bool (a bool temperature is a caller bug)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        return False
    return not math.isnan(x)


def process_logits(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = (),
                   mask: Optional[np.ndarray] = None) -> np.ndarray:
    """(V,) logits -> (V,) float64 probabilities of the processed distribution; `mask` (V,) bool, if given,
    keeps only the tokens a grammar allows (see process_logits_batch).

    Example: logits (2, 1, 0, -inf), temperature 1, top_k 2 -> softmax over ids {0, 1} = (0.731, 0.269, 0, 0).
    Greedy (temperature 0) returns a one-hot at the argmax, ties -> lowest id.
    """
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"process_logits expects (V,) logits, got shape {x.shape}")
    return process_logits_batch(x[None, :], params, [history], None if mask is None else mask[None, :])[0]


def plain_greedy(params: SamplingParams, masks: Optional[np.ndarray] = None) -> bool:
    """Whether greedy decoding under `params` is the raw logits' argmax: nothing (allowed set, grammar mask,
    repetition penalty) changes a row before it."""
    return params.greedy and params.allowed_tokens is None and masks is None and params.repetition_penalty == 1.0


def greedy_choices(logits: np.ndarray) -> np.ndarray:
    """(N, V) logits -> (N,) int64 argmax of each row (ties -> lowest id), read in place: what plain greedy
    verification needs, with no (N, V) array made. np.argmax returns a row's first NaN if it has one, so the
    chosen entries alone show a NaN or an all -inf row.

    Example: [[1, 3, 3], [0, -1, 2]] -> [1, 2]."""
    if logits.ndim != 2:
        raise ValueError(f"process_logits_batch expects (N, V) logits, got shape {logits.shape}")
    if logits.shape[0] == 1:  # a plain step: one row, checked as Python scalars (a few numpy calls fewer a token)
        best = np.array([logits[0].argmax()], np.int64)
        top = float(logits[0, best[0]])
        nan, minus_inf = top != top, top == -np.inf
    else:
        best = np.argmax(logits, axis=1)  # (N,)
        top = logits[np.arange(logits.shape[0]), best]
        nan, minus_inf = np.isnan(top).any(), np.isneginf(top).any()
    if nan:
        raise ValueError("logits contain NaN: the backend produced an invalid forward pass")
    if minus_inf:
        raise ValueError("every token has logit -inf (after the allowed-token / grammar mask): nothing can be sampled")
    return best


def _greedy_one_hot(logits: np.ndarray) -> np.ndarray:
    """(N, V) logits -> (N, V) float64 one-hot rows at greedy_choices: the general path's answer without its
    float64 copy and full-size NaN / -inf scans.

    Example: [[1, 3, 3]] -> [[0, 1, 0]]."""
    best = greedy_choices(logits)
    probs = np.zeros(logits.shape, np.float64)
    probs[np.arange(logits.shape[0]), best] = 1.0
    return probs


def process_logits_batch(
    logits: np.ndarray, params: SamplingParams, histories: Sequence[Sequence[int]] = (),
    masks: Optional[np.ndarray] = None,
) -> np.ndarray:
    """(N, V) logits -> (N, V) float64 probabilities; row i uses histories[i] for the repetition penalty
    and masks[i] ((N, V) bool, optional: the grammar's allowed tokens after row i's path) before anything else.

    `histories` may be empty when repetition_penalty == 1 (histories then do not matter).
    Example: logits (1, 1, 1), temperature 1, mask (True, False, True) -> (0.5, 0, 0.5).
    """
    if plain_greedy(params, masks):
        return _greedy_one_hot(np.asarray(logits))
    x = np.array(logits, dtype=np.float64)  # (N, V) private copy
    if x.ndim != 2:
        raise ValueError(f"process_logits_batch expects (N, V) logits, got shape {x.shape}")
    n, vocab = x.shape
    if np.isnan(x).any():
        raise ValueError("logits contain NaN: the backend produced an invalid forward pass")
    if params.allowed_tokens is not None:
        keep = np.zeros(vocab, dtype=bool)
        keep[np.asarray(params.allowed_tokens, dtype=np.int64)] = True
        x[:, ~keep] = -np.inf
    if masks is not None:
        x[~np.asarray(masks, dtype=bool)] = -np.inf
    if params.repetition_penalty != 1.0:
        if len(histories) != n:
            raise ValueError(f"need one history per row: {n} rows, {len(histories)} histories")
        for row, hist in zip(x, histories):
            _apply_repetition_penalty(row, hist, params.repetition_penalty)
    if np.isneginf(x).all(axis=1).any():
        raise ValueError("every token has logit -inf (after the allowed-token / grammar mask): nothing can be sampled")

    if params.greedy:
        probs = np.zeros_like(x)
        probs[np.arange(n), np.argmax(x, axis=1)] = 1.0  # np.argmax breaks ties towards the lowest id
        return probs

    z = x / params.temperature
    # +inf logits (or overflow after dividing by a tiny temperature) win outright, shared equally.
    pos_inf = np.isposinf(z)
    if pos_inf.any():
        rows = pos_inf.any(axis=1)
        z[rows] = np.where(pos_inf[rows], 0.0, -np.inf)
    if params.top_k > 0 and params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=1)[:, vocab - params.top_k]  # (N,) k-th largest
        z[z < kth[:, None]] = -np.inf  # ties at the k-th value are all kept
    probs = _softmax(z)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max(axis=1, keepdims=True)] = 0.0
        probs /= probs.sum(axis=1, keepdims=True)
    return probs


def _apply_repetition_penalty(row: np.ndarray, history: Sequence[int], penalty: float) -> None:
    """CTRL penalty in place: positive logits of seen tokens are divided by `penalty`, negative multiplied."""
    seen = np.unique(np.asarray(history, dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < row.shape[0])]
    vals = row[seen]
    row[seen] = np.where(vals > 0, vals / penalty, vals * penalty)


def _softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (N, V) float64 with -inf entries; every row has at least one finite entry."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest most-probable set (ties -> lower id first) whose mass reaches top_p; renormalise."""
    order = np.argsort(-probs, axis=1, kind="stable")  # (N, V)
    sorted_p = np.take_along_axis(probs, order, axis=1)
    mass_before = np.cumsum(sorted_p, axis=1) - sorted_p
    keep_sorted = mass_before < top_p - _TOP_P_TOLERANCE
    keep_sorted[:, 0] = True
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=1)
    out = np.where(keep, probs, 0.0)
    return out / out.sum(axis=1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF sample from (V,) probabilities (need not be normalised) with exactly one rng.random() draw.

    Example: probs (0.2, 0, 0.8): u < 0.2 -> 0, otherwise -> 2; id 1 is never returned.
    """
    p = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(p)
    total = cdf[-1] if cdf.size else 0.0
    if not (total > 0.0 and math.isfinite(total)) or (p < 0).any():
        raise ValueError("sample() needs non-negative probabilities with a positive, finite sum")
    u = rng.random() * total
    # side="right" picks the first index whose cdf exceeds u, which always has positive probability.
    i = int(np.searchsorted(cdf, u, side="right"))
    if i >= p.shape[0]:  # u rounded up to the total: take the last id that can be drawn
        i = int(np.flatnonzero(p > 0)[-1])
    return i
