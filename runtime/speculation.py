"""The shape/cost rule: how many draft nodes a cycle should verify, from a measured cost model and the acceptance
seen so far. The one place this is decided; every drafter gets the answer as `DraftContext.max_nodes`.

A cycle that drafts K nodes costs  T(K) = verify(K + 1) + draft(K)   (seconds; draft(0) = 0: nothing runs)
and commits             E(K) = 1 + sum_{k=1..K} prod_{i<=k} alpha_i   tokens on average,
where alpha_d = P(the node at depth d is accepted | depth d-1 was). The rate E(K) / T(K) is tokens per second;
K = 0 is plain decoding, 1 / verify(1). The rule picks the K with the best rate, so speculation never plans to
be slower than plain decoding: where the drafter is rarely right, K = 0 wins and the cycle drafts nothing, except
a short probe now and then (`AdaptivePolicy.probe_every`) so that a domain where the drafter becomes useful again
is noticed.

Exactness: the shape is a function of the history only (past cycles' acceptance, the cost model), never of the
target's outputs for the cycle being verified, and verification is exact for any draft shape. So the emitted
tokens keep the target's distribution whatever this module decides; greedy output is unchanged.

For a tree drafter the node budget K caps the tree's nodes and alpha_d is measured along its accepted path; the
chain formula then under-states what K tree nodes earn, which errs towards drafting less (never towards losing to
plain decoding, which K = 0 still guards)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


def expected_tokens(alphas: Sequence[float]) -> float:
    """Tokens a cycle commits on average when it drafts len(alphas) chained nodes with conditional acceptance
    alphas[d-1] at depth d (the +1 is the target's own token after the accepted prefix).

    >>> expected_tokens([])
    1.0
    >>> round(expected_tokens([0.8, 0.5]), 2)  # 1 + 0.8 + 0.8 * 0.5
    2.2"""
    total, reach = 1.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


@dataclass(frozen=True)
class CostModel:
    """Seconds of one verify forward of n rows (`verify[(n, seconds)]`, measured at n = 1 and a few more) and of
    drafting: `draft_fixed` once per cycle that drafts, plus `draft_per_node` per drafted node (a draft model or
    EAGLE runs once per node; a DFlash block is nearly all fixed cost)."""
    verify: Tuple[Tuple[int, float], ...]  # ((rows, seconds), ...) sorted by rows; rows >= 1
    draft_fixed: float = 0.0
    draft_per_node: float = 0.0

    def verify_s(self, n: int) -> float:
        """Piecewise-linear in n through the measured points, extended past the last one with the last slope
        (or flat when only one point is known).

        >>> CostModel(((1, 1.0), (5, 2.0))).verify_s(3)
        1.5
        >>> CostModel(((1, 1.0), (5, 2.0))).verify_s(9)
        3.0"""
        pts = self.verify
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        if len(pts) == 1:
            return pts[0][1]
        (n0, s0), (n1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) / (n1 - n0) * (n - n1)

    def cycle_s(self, k: int) -> float:
        """T(k): verify k + 1 rows, after drafting k nodes (nothing drafted at k = 0)."""
        return self.verify_s(k + 1) + (self.draft_fixed + self.draft_per_node * k if k > 0 else 0.0)


def rate(alphas: Sequence[float], cost: CostModel, k: int) -> float:
    """Expected tokens per second when a cycle drafts k nodes (alphas past the end repeat the last one).

    >>> cost = CostModel(((1, 1.0), (2, 1.1), (3, 1.2)), draft_per_node=0.1)
    >>> rate([0.9, 0.9], cost, 0), round(rate([0.9, 0.9], cost, 2), 3)  # 1 / 1.0 and (1 + .9 + .81) / 1.4
    (1.0, 1.936)"""
    return expected_tokens(_extend(alphas, k)) / cost.cycle_s(k)


def best_depth(alphas: Sequence[float], cost: CostModel, k_max: int) -> int:
    """The node budget in [0, k_max] with the best expected rate (the smaller one on ties: fewer rows, same gain).

    A drafter right half the time at a verify that costs 1.5x a step per extra row loses to plain decoding:
    >>> best_depth([0.5] * 4, CostModel(((1, 1.0), (2, 1.5)), draft_per_node=0.05), 4)
    0

    A drafter right 80 % of the time where extra verify rows are nearly free (a GPU's verify) and a draft
    step costs 2 % of a step drafts all 8; at 15 % a step, 4 nodes earn the most:
    >>> best_depth([0.8] * 8, CostModel(((1, 1.0), (9, 1.1)), draft_per_node=0.02), 8)
    8
    >>> best_depth([0.8] * 8, CostModel(((1, 1.0), (9, 1.1)), draft_per_node=0.15), 8)
    4"""
    best_k, best = 0, rate(alphas, cost, 0)
    for k in range(1, k_max + 1):
        r = rate(alphas, cost, k)
        if r > best * (1 + 1e-9):
            best_k, best = k, r
    return best_k


def _extend(alphas: Sequence[float], k: int) -> List[float]:
    a = list(alphas[:k])
    while len(a) < k:
        a.append(a[-1] if a else 0.0)
    return a


@dataclass
class AcceptanceTracker:
    """Conditional acceptance by depth, with old cycles fading out (`decay` per observed cycle). Each depth's
    estimate is pulled by `prior_weight` pseudo-cycles towards the depth above it (depth 1: towards `prior`), so
    a depth the rule has rarely drafted is believed to be like the last one it knows, and gets tried.

    >>> t = AcceptanceTracker(prior=0.5, prior_weight=0.0, decay=1.0)
    >>> t.observe(drafted=3, accepted=1); t.observe(drafted=3, accepted=3)
    >>> t.alphas(3)  # depth 1: 2 of 2; depth 2: 1 of 2 reached it; depth 3: 1 of 1
    [1.0, 0.5, 1.0]"""
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.97
    reached: List[float] = field(default_factory=list)  # [d-1]: cycles that drafted depth d with depth d-1 accepted
    hit: List[float] = field(default_factory=list)  # [d-1]: ... and accepted depth d

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.reached = [x * self.decay for x in self.reached]
        self.hit = [x * self.decay for x in self.hit]
        while len(self.reached) < drafted:
            self.reached.append(0.0)
            self.hit.append(0.0)
        for d in range(1, min(drafted, accepted + 1) + 1):
            self.reached[d - 1] += 1.0
            self.hit[d - 1] += float(accepted >= d)

    def alphas(self, k: int) -> List[float]:
        out = []
        for d in range(1, k + 1):
            seen = d <= len(self.reached)
            reached, hit = (self.reached[d - 1], self.hit[d - 1]) if seen else (0.0, 0.0)
            prior = out[-1] if out else self.prior  # a rarely drafted depth is believed to be like the one above
            w = self.prior_weight
            out.append((hit + w * prior) / (reached + w) if reached + w > 0 else prior)
        return out


@dataclass
class AdaptivePolicy:
    """Chooses each cycle's node budget per request template ("planner", "action", "text", ...): the best-rate
    depth under `cost` (fixed when tuned; learnt from the cycles' own timings when `learn_costs`), with a probe
    of `probe_depth` nodes every `probe_every` cycles while the best is to draft nothing."""
    cost: CostModel
    k_max: int
    learn_costs: bool = False
    probe_every: int = 16
    probe_depth: int = 2
    prior: float = 0.5
    trackers: Dict[str, AcceptanceTracker] = field(default_factory=dict)
    idle: Dict[str, int] = field(default_factory=dict)  # cycles since the last draft, per template
    skipped: int = 0  # cycles that drafted nothing because the rule said so
    probes: int = 0
    _verify: Dict[int, float] = field(default_factory=dict)  # learnt seconds per verify rows (EMA)
    _draft: Optional[float] = None  # learnt seconds per drafted node (EMA)
    _best: Dict[str, int] = field(default_factory=dict)  # best_depth per template, until its inputs change

    def tracker(self, key: str) -> AcceptanceTracker:
        if key not in self.trackers:
            self.trackers[key] = AcceptanceTracker(prior=self.prior)
        return self.trackers[key]

    def budget(self, key: str) -> int:
        """The node budget for the next cycle of a request of template `key`."""
        k = self._best.get(key)
        if k is None:  # recomputed only when what it depends on moved: a cycle that drafts nothing costs a lookup
            k = self._best[key] = best_depth(self.tracker(key).alphas(self.k_max), self.current_cost(), self.k_max)
        if k > 0:
            self.idle[key] = 0
            return k
        self.idle[key] = self.idle.get(key, 0) + 1
        if self.probe_every and self.idle[key] >= self.probe_every:
            self.idle[key] = 0
            self.probes += 1
            return min(self.probe_depth, self.k_max)
        self.skipped += 1
        return 0

    def observe(self, key: str, drafted: int, accepted: int, verify_rows: int, verify_s: float,
                draft_s: float) -> None:
        """What the cycle drafted (its depth), accepted, and how long its verify and drafting took."""
        self.tracker(key).observe(drafted, accepted)
        if drafted > 0:
            self._best.pop(key, None)  # its acceptance moved
        if not self.learn_costs:
            return
        self._best.clear()  # the costs move with every cycle's timing
        old = self._verify.get(verify_rows)
        self._verify[verify_rows] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        if drafted > 0:
            per = draft_s / drafted
            self._draft = per if self._draft is None else 0.8 * self._draft + 0.2 * per

    def current_cost(self) -> CostModel:
        if not self.learn_costs or not self._verify:
            return self.cost
        learnt = dict(self.cost.verify)
        learnt.update(self._verify)
        pts = tuple(sorted(learnt.items()))
        per = self.cost.draft_per_node if self._draft is None else self._draft
        return CostModel(pts, 0.0 if self._draft is not None else self.cost.draft_fixed, per)


def default_cost(verify_row_share: float = 0.1, draft_share: float = 0.05) -> CostModel:
    """A cost model in units of one plain step, for a policy that learns the real costs as it runs: each extra
    verify row costs `verify_row_share` of a step and each drafted node `draft_share`."""
    return CostModel(((1, 1.0), (2, 1.0 + verify_row_share)), 0.0, draft_share)


def speedup_over_plain(alphas: Sequence[float], cost: CostModel, k: int) -> float:
    """rate(k) / rate(0): the speed-up the model expects of drafting k nodes.

    >>> round(speedup_over_plain([0.9, 0.9], CostModel(((1, 1.0), (3, 1.2)), draft_per_node=0.1), 2), 3)
    1.936"""
    plain = rate(alphas, cost, 0)
    return rate(alphas, cost, k) / plain if plain > 0 and math.isfinite(plain) else 0.0
