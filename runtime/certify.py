"""`edgespec certify`: a statistical proof, on the robot's own bundle and backend, that speculative
decoding does not change the target's distribution.

For each context, the real engine (real drafter, real verification, real models) is run many times
from the same state with different seeds; the empirical distribution of the first emitted token and of
the first two emitted tokens is compared with the exact target distribution, computed by enumeration,
by a chi-square goodness-of-fit test. Models are wrapped in `MemoModel`, which answers a forward from
a cache keyed by the token path each row sees — the numbers are the model's own, only never computed
twice — so tens of thousands of draws take seconds to minutes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from runtime.backends.base import ForwardResult
from runtime.engine import Engine
from runtime.layers import causal_mask
from runtime.sampling import SamplingParams, process_logits
from runtime.stat_tests import chi_square_gof


class MemoModel:
    """A TargetBackend wrapper that memoises each row's output by the token path it attends to.

    Exact by construction: a causal decoder's output at a position depends only on the tokens it can
    see, in position order; a miss runs the wrapped model on that whole path from an empty cache."""

    def __init__(self, model, taps: Sequence[str] = ()):
        self.model = model
        self.spec = model.spec
        self.name = model.name
        self.taps = tuple(taps)
        self.rows: List[int] = []  # token of each virtual cache row
        self.memo: Dict[Tuple[int, ...], Tuple[np.ndarray, Dict[str, np.ndarray]]] = {}
        self.misses = 0

    @property
    def cache_len(self) -> int:
        return len(self.rows)

    @property
    def max_cache_len(self) -> int:
        return self.model.max_cache_len

    def _compute(self, path: Tuple[int, ...]) -> None:
        self.misses += 1
        self.model.reset()
        res = self.model.forward(np.asarray(path, np.int64), np.arange(len(path)), None, self.taps)
        for i in range(len(path)):
            self.memo.setdefault(path[:i + 1], (res.logits[i], {k: v[i] for k, v in res.taps.items()}))
        self.model.reset()

    def forward(self, tokens, positions, mask=None, taps=()) -> ForwardResult:
        tokens = [int(t) for t in tokens]
        base = len(self.rows)
        if mask is None:
            mask = causal_mask(base, len(tokens))
        seen = self.rows + tokens
        logits, tap_rows = [], {k: [] for k in taps}
        for j in range(len(tokens)):
            path = tuple(seen[c] for c in np.nonzero(mask[j])[0])
            if path not in self.memo:
                self._compute(path)
            row_logits, row_taps = self.memo[path]
            logits.append(row_logits)
            for k in taps:
                tap_rows[k].append(row_taps[k])
        self.rows = seen
        return ForwardResult(np.stack(logits), {k: np.stack(v) for k, v in tap_rows.items()})

    def keep(self, start: int, rows: Sequence[int]) -> None:
        self.rows = self.rows[:start] + [self.rows[r] for r in rows]

    def reset(self) -> None:
        self.rows = []

    def distribution(self, path: Sequence[int], params: SamplingParams) -> np.ndarray:
        key = tuple(int(t) for t in path)
        if key not in self.memo:
            self._compute(key)
        return process_logits(self.memo[key][0], params, key)


@dataclass
class ContextResult:
    context: str
    draws: int
    first_statistic: float
    first_p_value: float
    pair_statistic: float
    pair_p_value: float
    alpha: float
    tau: float

    @property
    def passed(self) -> bool:
        return self.first_p_value >= self.alpha and self.pair_p_value >= self.alpha


def exact_pair_distribution(target: MemoModel, prefix: Sequence[int], params: SamplingParams, min_mass: float):
    """p(t1) and the joint p(t1, t2) for every t1 with p(t1) >= min_mass; the other t1 share one bin."""
    p1 = target.distribution(prefix, params)
    heads = [int(t) for t in np.nonzero(p1 >= min_mass)[0]]
    joint = {t: p1[t] * target.distribution(list(prefix) + [t], params) for t in heads}
    return p1, joint


def certify_context(engine: Engine, target: MemoModel, prompt: Sequence[int], params: SamplingParams, draws: int,
                    alpha: float, seed: int, label: str, min_mass: float = 1e-4) -> ContextResult:
    root = int(np.argmax(target.distribution(prompt, SamplingParams())))  # a natural continuation to start from
    prefix = list(prompt) + [root]
    p1, joint = exact_pair_distribution(target, prefix, params, min_mass)
    vocab = p1.shape[0]
    heads = sorted(joint)
    head_index = {t: i for i, t in enumerate(heads)}
    first_counts = np.zeros(vocab)
    pair_counts = np.zeros(len(heads) * vocab + 1)  # last bin: t1 outside the enumerated heads
    emitted = cycles = 0
    for i in range(draws):
        out = engine.generate(prompt, params, max_tokens=3, seed=seed + i, first_token=root)
        t1, t2 = out.tokens[1], out.tokens[2]
        first_counts[t1] += 1
        pair_counts[head_index[t1] * vocab + t2 if t1 in head_index else -1] += 1
        emitted += len(out.tokens) - 1
        cycles += out.stats.cycles
    pair_probs = np.concatenate([joint[t] for t in heads] + [[max(0.0, 1.0 - sum(p1[t] for t in heads))]])
    pair_probs /= pair_probs.sum()
    g1 = chi_square_gof(first_counts, p1)
    g2 = chi_square_gof(pair_counts, pair_probs)
    return ContextResult(label, draws, g1.statistic, g1.p_value, g2.statistic, g2.p_value, alpha,
                         emitted / cycles if cycles else 0.0)


def memoise_session(session) -> MemoModel:
    """Swap the session's target (and draft model) for memoising wrappers; returns the target's."""
    taps = session.drafter.target_taps if session.drafter else ()
    target = MemoModel(session.target, taps)
    session.engine.target = target
    if session.drafter is not None and hasattr(session.drafter, "model"):
        session.drafter.model = MemoModel(session.drafter.model)
    return target


def certify(session, contexts: Sequence[str], params: SamplingParams, draws: int = 20000, alpha: float = 1e-3,
            seed: int = 0, verifier: Optional[Callable] = None,
            progress: Optional[Callable[[ContextResult], None]] = None) -> List[ContextResult]:
    target = memoise_session(session)
    session.engine.eos = set()  # EOS is one more outcome here, not the end of the draw
    if verifier is not None:
        session.engine.sampled_verifier = verifier
    results = []
    for k, text in enumerate(contexts):
        prompt = session.tokenizer.encode(text)
        res = certify_context(session.engine, target, prompt, params, draws, alpha, seed + 1_000_003 * k, text)
        results.append(res)
        if progress:
            progress(res)
    return results
