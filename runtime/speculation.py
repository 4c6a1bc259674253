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
plain decoding, which K = 0 still guards).

Within a cycle that drafts, `NodeRule` (below) cuts the draft node by node: a node is kept only while its
expected gain, from the drafter's calibrated confidence, beats its marginal draft + verify cost; so a chain stops
on an uncertain token, EAGLE-2's tree keeps the nodes it earns and a DFlash block is cut where its slots stop
paying. Every drafter asks the same rule through `DraftContext.stop`."""
from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


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


TABLE_ROWS = 129  # verify rows CostModel.verify_s keeps a table of (a draft of 128 nodes and its root)


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
        (or flat when only one point is known); read from a table up to TABLE_ROWS rows (the adaptive rule asks
        ~20 times a drafting cycle).

        >>> CostModel(((1, 1.0), (5, 2.0))).verify_s(3)
        1.5
        >>> CostModel(((1, 1.0), (5, 2.0))).verify_s(9)
        3.0"""
        table = self._table
        return table[n] if 0 <= n < len(table) else self._interpolate(n)

    @functools.cached_property
    def _table(self) -> Tuple[float, ...]:
        return tuple(self._interpolate(n) for n in range(TABLE_ROWS))

    def _interpolate(self, n: int) -> float:
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
    tokens, reach, last = 1.0, 1.0, 0.0  # rate(alphas, cost, k) for k = 1, 2, ... in one pass
    for k in range(1, k_max + 1):
        last = alphas[k - 1] if k <= len(alphas) else last  # alphas past the end repeat the last one
        reach *= last
        tokens += reach
        r = tokens / cost.cycle_s(k)
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
    _alphas: Dict[int, List[float]] = field(default_factory=dict, repr=False, compare=False)  # until observe

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._alphas = {}
        self.reached = [x * self.decay for x in self.reached]
        self.hit = [x * self.decay for x in self.hit]
        while len(self.reached) < drafted:
            self.reached.append(0.0)
            self.hit.append(0.0)
        for d in range(1, min(drafted, accepted + 1) + 1):
            self.reached[d - 1] += 1.0
            self.hit[d - 1] += float(accepted >= d)

    def alphas(self, k: int) -> List[float]:
        if k in self._alphas:  # asked by the depth search and the per-node rule: once per observed cycle
            return list(self._alphas[k])
        out = []
        for d in range(1, k + 1):
            seen = d <= len(self.reached)
            reached, hit = (self.reached[d - 1], self.hit[d - 1]) if seen else (0.0, 0.0)
            prior = out[-1] if out else self.prior  # a rarely drafted depth is believed to be like the one above
            w = self.prior_weight
            out.append((hit + w * prior) / (reached + w) if reached + w > 0 else prior)
        self._alphas[k] = out
        return list(out)


@dataclass
class AdaptivePolicy:
    """Chooses each cycle's node budget per request template ("planner", "action", "text", ...): the best-rate
    depth under `cost` (fixed when tuned; learnt from the cycles' own timings when `learn_costs`), with a probe
    of `probe_depth` nodes every `probe_every` cycles while the best is to draft nothing. A probe costs more than
    its nodes (a draft model or EAGLE head first catches up on every token committed since it last ran), so each
    probe that leaves the best at nothing doubles the template's interval, up to `probe_max` cycles; one that is
    accepted whole, or makes drafting pay, brings it back to `probe_every`. Whatever the doubling says, the wait
    is never so short that probes take more than `probe_share` of the template's time (`probe_wait`): a probe
    that costs 2 plain steps more than the step it replaces is followed by at least 200 idle cycles at 1 %.
    A template that drafts nothing because its drafting cycles were measured not to earn (`realized`, below) is
    probed with the shape it planned, per-node rule included, timed at the cost model: a slow spell (a drafter's
    first-run allocations, a busy CPU) must not stop drafting there for good, and two whole nodes cannot show
    that a planned eight pay again."""
    cost: CostModel
    k_max: int
    learn_costs: bool = False
    probe_every: int = 16
    probe_depth: int = 2
    probe_max: int = 1024
    probe_share: Optional[float] = 0.01  # None: the doubling rule alone sets the wait, whatever a probe costs
    # The longest run of plain steps the engine takes without asking (`plain_run`): each run's end costs a policy
    # lookup and a drafter's catch-up bookkeeping (~0.1 ms per end on the zoo); 64 leaves one or two per request
    plain_run_most: int = 64
    # A template's first probe: after `probe_every` idle cycles (False), or after the wait `probe_share` gives a
    # probe of what the cost model says one costs (True: a tuned policy, whose costs were measured on this machine)
    first_probe_from_cost: bool = False
    prior: float = 0.5
    trackers: Dict[str, AcceptanceTracker] = field(default_factory=dict)
    idle: Dict[str, int] = field(default_factory=dict)  # cycles since the last draft, per template
    interval: Dict[str, int] = field(default_factory=dict)  # idle cycles before the next probe, per template
    skipped: int = 0  # cycles that drafted nothing because the rule said so
    probes: int = 0
    _verify: Dict[int, float] = field(default_factory=dict)  # learnt seconds per verify rows (EMA)
    _draft: Optional[float] = None  # learnt seconds per drafted node (EMA)
    _best: Dict[str, int] = field(default_factory=dict)  # best_depth per template, until its inputs change
    _searched: Dict[str, Tuple[int, float]] = field(default_factory=dict)  # (depth, rate) of the search, until
    # the template's acceptance or the costs move (a proposal that kept no node moves only the veto's evidence)
    _rate: Dict[str, float] = field(default_factory=dict)  # ... and the rate it expects there
    _rules: Dict[str, "NodeRule"] = field(default_factory=dict)  # node_rule per template, until _best moves
    _probing: Dict[str, str] = field(default_factory=dict)  # the template's last budget was a probe: "short" / "full"
    _vetoed: Dict[str, int] = field(default_factory=dict)  # templates the realized rate vetoed: the depth planned there
    _lifted: Dict[str, int] = field(default_factory=dict)  # templates a paying probe un-vetoed: the wait then
    _probe_s: Dict[str, float] = field(default_factory=dict)  # seconds the template's last probe cost over a plain step
    # What the template's drafting cycles really earned: [tokens, their seconds as timed in plain steps of the
    # scaled cost model, cycles], decayed by
    # `realized_decay` a cycle. The depth search trusts the chain formula, but the per-node rule may keep far fewer
    # nodes than it plans for (or none, after the drafter's fixed cost is paid): once `realized_min` cycles say
    # drafting earns less than `realized_floor` of plain steps' rate, losing `realized_loss` of a step a cycle by
    # it, the template drafts nothing but probes.
    realized: Dict[str, List[float]] = field(default_factory=dict)
    realized_decay: float = 0.9
    realized_min: float = 4.0
    realized_floor: float = 0.97  # (a clear loss: the rule's own plan keeps a near-even template drafting)
    # ... and a loss worth a veto: the drafting cycles lost at least this share of a plain step each, on average. A
    # drafter whose misses cost next to nothing (an n-gram lookup that finds no match: ~5 % of a zoo step, policy
    # included) keeps looking through a request's first, unmatched cycles instead of being parked before its
    # matches come; an EAGLE-3 tree that earns 2.9 tokens in 3.2 steps' time (0.25 lost a cycle) is vetoed.
    realized_loss: float = 0.1
    # ... and one cycle's timing counts at most `realized_clip` times what the scaled cost model says its shape
    # costs: an outlier (a context switch, a collection, a shape's first run: 5 plain steps for a 1-row verify,
    # measured on the zoo) would otherwise outweigh ten cycles of a template that pays; a drafter that really
    # costs more than the model says still shows up to twice over, and in the scales
    realized_clip: float = 2.0
    _handed: Dict[str, int] = field(default_factory=dict)  # the budget the template's last cycle got
    _kept: Dict[str, int] = field(default_factory=dict)  # ... and the nodes it drafted (observe_nodes)
    # Per-node early stopping (NodeRule): where drafting pays, the drafter gets k_max nodes and keeps each only
    # while its calibrated gain beats its cost; the depth search above then only decides whether to draft at all.
    per_node: bool = True
    calibrations: Dict[str, Calibration] = field(default_factory=dict)  # per temperature class: greedy / sampled
    # The tuned costs, scaled by what this process measures (unless `learn_costs`): the tune timed its verify
    # rows at other context lengths, in another process, maybe on a busier machine, so each cycle's verify seconds
    # against the model's for its rows, and a drafting cycle's draft seconds against the model's for its nodes,
    # move one scale each (`_scale`: an EMA of weight `scale_weight`, each ratio clipped to 1/4 .. 4; a probe's
    # drafting, which includes its catch-up, is left out). The depths are searched again only when a scale has
    # moved by more than `rescale_step` since the last search: a plain step stays a lookup.
    scale_costs: bool = True
    scale_weight: float = 0.05
    rescale_step: float = 0.05
    _scale: List[float] = field(default_factory=lambda: [1.0, 1.0])  # [verify, draft]: measured / modelled (EMA)
    _scaled: Optional[Tuple[Tuple[float, float], CostModel]] = None  # (the scales it was made with, the cost model)

    def tracker(self, key: str) -> AcceptanceTracker:
        if key not in self.trackers:
            self.trackers[key] = AcceptanceTracker(prior=self.prior)
        return self.trackers[key]

    def budget(self, key: str) -> int:
        """The node budget for the next cycle of a request of template `key`."""
        k = self.budget_depth(key)  # recomputed only when its inputs moved: a cycle that drafts nothing costs a lookup
        self._probing[key] = ""
        b = 0
        if k > 0:
            self.idle[key] = 0
            self.interval.pop(key, None)  # the wait before a probe is set when the template next drafts nothing
            b = self.k_max if self.per_node else k
        else:
            self.idle[key] = self.idle.get(key, 0) + 1
            if key not in self.interval:
                self.interval[key] = self.probe_wait(key)
            if self.probe_every and self.idle[key] >= self.interval[key]:
                self.idle[key] = 0
                self.probes += 1
                if key in self._vetoed:  # re-try the planned shape: a short probe cannot show it pays again
                    self._probing[key] = "full"
                    b = self.k_max if self.per_node else self._vetoed[key]
                else:
                    self._probing[key] = "short"
                    b = min(self.probe_depth, self.k_max)
            else:
                self.skipped += 1
        self._handed[key] = b
        return b

    def plain_run(self, key: str, most: Optional[int] = None) -> int:
        """After a cycle `budget(key)` gave nothing: how many of the template's next cycles are sure to get
        nothing too (no probe falls due before them), at most `most` (default `plain_run_most`). The engine runs
        them as plain steps without asking `budget` and `observe` each cycle and reports them in one `skip`, so
        that a drafter which does not pay there costs what it costs to hold, not a policy lookup a token (on the
        zoo those lookups, run on caches the target's forward has just evicted, cost 1-2 % of a plain step).
        `most` bounds how long a depth search the verify scale would start waits. History only, as `budget`; 0
        where each cycle's timing is learnt from (`learn_costs`).

        >>> p = AdaptivePolicy(CostModel(((1, 1.0), (2, 2.0))), 4, prior=0.1, probe_share=None)
        >>> p.budget("action/greedy"), p.plain_run("action/greedy")  # idle 1 of 16: the probe is 15 cycles off
        (0, 14)"""
        if self.learn_costs or self._best.get(key) != 0 or self._handed.get(key):
            return 0
        most = self.plain_run_most if most is None else most
        if not self.probe_every:
            return most
        return max(0, min(most, self.interval.get(key, self.probe_every) - self.idle.get(key, 0) - 1))

    def skip(self, key: str, verify_s: Sequence[float]) -> None:
        """The plain steps of a run `plain_run` allowed, `verify_s` seconds each: the state that as many calls of
        `budget` (each giving 0) and `observe` leave, but that a depth search the verify scale's moving would have
        started inside the run waits for its end (at most `plain_run`'s bound of cycles later).

        >>> p = AdaptivePolicy(CostModel(((1, 1.0), (2, 2.0))), 4, prior=0.1, probe_share=None, scale_weight=0.5)
        >>> p.budget("action/greedy"); p.skip("action/greedy", [0.5, 0.5])  # two steps at half the modelled second
        0
        >>> p.idle["action/greedy"], p.skipped, p._scale[0]  # 1 -> 0.75 -> 0.625, as two observe calls move it
        (3, 3, 0.625)"""
        if not verify_s:
            return
        self.idle[key] = self.idle.get(key, 0) + len(verify_s)
        self.skipped += len(verify_s)
        if self.scale_costs and not self.learn_costs:
            # _rescale's verify half, step by step in local variables (a run's steps come in at once, and the
            # depths they would make stale are not read before it ends): one check of the scale at the end
            w, modelled, scale = self.scale_weight, self.cost.verify_s(1), self._scale[0]
            if modelled > 0:
                for seconds in verify_s:
                    if seconds > 0:
                        scale += w * (min(4.0, max(0.25, seconds / modelled)) - scale)
            self._scale[0] = scale
            self._rescale(1, 0.0, 0, 0.0)  # moves nothing: forgets the searched depths if the scale moved enough

    def probe_wait(self, key: str) -> int:
        """The fewest idle cycles before the template's next probe: `probe_every`, or more where a probe would
        otherwise take over `probe_share` of the time: the seconds the template's last probe cost beyond the plain
        step it replaced (its catch-up, head runs and extra verify rows, as timed) over probe_share of a plain
        step (the cost model's verify(1)); at most `probe_max`. The template's first probe comes after
        `probe_every` (nothing is known of its cost yet, and the prior may be all the policy knows of the
        template), or, with `first_probe_from_cost` (a tuned policy: its costs and acceptance were measured here),
        after the wait of a probe costing what the model says: its drafting and extra verify rows (a catch-up
        comes on top, so the measured cost of that probe then sets the next wait). History only: timings of past
        cycles and the cost model.

        >>> p = AdaptivePolicy(CostModel(((1, 1.0),)), 4)
        >>> p.probe_wait("action/greedy")
        16
        >>> p._probe_s["action/greedy"] = 1.6  # the last probe cost 1.6 steps over a plain one: / 0.01 -> 160
        >>> p.probe_wait("action/greedy")
        160
        >>> tuned = AdaptivePolicy(CostModel(((1, 1.0), (3, 1.2)), 0.5, 0.4), 4, first_probe_from_cost=True)
        >>> tuned.probe_wait("action/greedy")  # 2 nodes: 0.5 + 2 x 0.4 drafting + 0.2 of verify rows -> 150
        150"""
        extra = self._probe_s.get(key)
        if extra is None and self.first_probe_from_cost:
            c = self.current_cost()
            extra = c.cycle_s(min(self.probe_depth, self.k_max)) - c.verify_s(1)
        if not self.probe_share or extra is None:
            return self.probe_every
        step = self.current_cost().verify_s(1)
        wait = math.ceil(round(extra / (self.probe_share * step), 6)) if step > 0 else self.probe_max
        return int(min(self.probe_max, max(self.probe_every, wait)))

    def budget_depth(self, key: str) -> int:
        """The best depth of the template as its acceptance stands (0: plain steps pay best), without taking a
        cycle's budget."""
        if key not in self._best:
            if key not in self._searched:
                alphas, cost = self.tracker(key).alphas(self.k_max), self.current_cost()
                k = best_depth(alphas, cost, self.k_max)
                self._searched[key] = (k, rate(alphas, cost, k))
            k, self._rate[key] = self._searched[key]
            tokens, steps, cycles = self.realized.get(key, (0.0, 0.0, 0.0))
            self._vetoed.pop(key, None)
            if (k > 0 and cycles >= self.realized_min and tokens / steps < self.realized_floor
                    and steps - tokens >= self.realized_loss * cycles):
                self._vetoed[key] = k  # planned to pay, measured not to: plain steps and probes of the planned
                k = 0  # shape (`budget`), timed at the cost model, until the drafts earn again
                if key in self._lifted:  # a lifted veto that did not hold: probe half as often as then
                    self.interval[key] = min(self.probe_max, 2 * self._lifted.pop(key))
            self._best[key] = k
        return self._best[key]

    def calibration(self, key: str) -> Calibration:
        """The confidence calibration of the key's temperature class ("planner/greedy" -> "greedy")."""
        cls = key.rsplit("/", 1)[-1]
        if cls not in self.calibrations:
            self.calibrations[cls] = Calibration(prior=self.prior)
        return self.calibrations[cls]

    def node_rule(self, key: str) -> Optional["NodeRule"]:
        """The per-node rule for the cycle `budget(key)` just sized (None when per-node stopping is off, and for a
        short probe: it drafts its few nodes whole, since it is there to measure them and its catch-up is paid
        anyway; a probe of a vetoed template's planned shape keeps the rule, which is part of what it measures).
        Built again only when the template's best depth is recomputed (its acceptance or the costs moved)."""
        if not self.per_node or self._probing.get(key) == "short":
            return None
        rule = self._rules.get(key)
        if rule is None:
            cost = self.current_cost()
            reach = tuple(itertools.accumulate(self.tracker(key).alphas(self.k_max), operator.mul))
            rule = self._rules[key] = NodeRule.make(cost, self.calibration(key),
                                                    self._rate.get(key) or 1.0 / cost.verify_s(1), self.k_max, reach)
        return rule

    def observe_nodes(self, key: str, confidence: Sequence[float], accepted: Sequence[bool]) -> None:
        """The cycle's drafted nodes: path confidences and which were accepted (the calibration learns on)."""
        self.calibration(key).observe(confidence, accepted)
        self._kept[key] = len(confidence)

    def observe(self, key: str, drafted: int, accepted: int, verify_rows: int, verify_s: float,
                draft_s: float) -> None:
        """What the cycle drafted (its depth), accepted, and how long its verify and drafting took."""
        if drafted <= 0 and not self._handed.get(key) and not self.learn_costs:
            # a plain step the rule chose (most cycles of a template that does not pay): only the verify scale moves
            self._handed.pop(key, None)
            self._kept.pop(key, None)
            if self.scale_costs:
                self._rescale(verify_rows, verify_s, 0, 0.0)
            return
        self.tracker(key).observe(drafted, accepted)
        nodes = self._kept.pop(key, drafted)
        proposed = self._handed.pop(key, 0) > 0
        if proposed:  # the drafter ran: its fixed cost is paid even where it kept no node
            c = self.current_cost()
            # as timed (a probe's catch-up aside: its nodes at the model's cost), in plain steps at the scaled model;
            # a proposal that kept no node was verified as a plain step is, so its verify counts as one (the
            # noise of a 1-row forward, +-20 % a cycle here, vetoed n-gram misses within four cycles), its
            # drafting as timed
            modelled = c.verify_s(nodes + 1) + c.draft_fixed + c.draft_per_node * nodes
            timed = (verify_s if nodes else c.verify_s(1)) + draft_s
            seconds = (min(timed, self.realized_clip * modelled)
                       if not self._probing.get(key) and verify_s > 0 else modelled)
            steps = seconds / c.verify_s(1)
            old = self.realized.get(key, (0.0, 0.0, 0.0))
            d = self.realized_decay
            if self._probing.get(key) == "full" and (1.0 + accepted) / steps >= self.realized_floor:
                # the planned shape measured to pay: the veto's old evidence (a slow spell) is dropped, this
                # cycle's kept, and should the drafts that follow veto the template again, its wait doubles
                self.realized[key] = [1.0 + accepted, steps, 1.0]
                self._lifted[key] = self.interval.get(key, self.probe_every)
            else:
                self.realized[key] = [d * old[0] + 1.0 + accepted, d * old[1] + steps, d * old[2] + 1.0]
        if drafted > 0 or proposed:
            self._best.pop(key, None)  # its acceptance or the veto's evidence moved
            self._rules.pop(key, None)
            if drafted > 0:
                self._searched.pop(key, None)
        probing = bool(self._probing.pop(key, ""))
        if self.scale_costs and not self.learn_costs:
            self._rescale(verify_rows, verify_s, nodes if proposed and not probing else 0, draft_s)
        if probing:
            self._probe_s[key] = max(0.0, verify_s + draft_s - self.current_cost().verify_s(1))
            # a probe taken whole is evidence the template may pay again: probe soon, not after the longest wait
            # (but never so often that probes of what this one cost take over probe_share of the time)
            again = self.budget_depth(key) > 0 or (drafted > 0 and accepted >= drafted)
            every = self.interval.get(key, self.probe_every)
            self.interval[key] = max(self.probe_wait(key), self.probe_every if again else min(self.probe_max, 2 * every))
        if not self.learn_costs:
            return
        self._best.clear()  # the costs move with every cycle's timing
        self._searched.clear()
        self._rules.clear()
        old = self._verify.get(verify_rows)
        self._verify[verify_rows] = verify_s if old is None else 0.8 * old + 0.2 * verify_s
        if drafted > 0:
            per = draft_s / drafted
            self._draft = per if self._draft is None else 0.8 * self._draft + 0.2 * per

    def _rescale(self, rows: int, verify_s: float, nodes: int, draft_s: float) -> None:
        """Move the cost scales by one cycle's timings; forget the searched depths once a scale moved enough.

        >>> p = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.2)), 0.1, 0.1), 4, scale_weight=0.5)
        >>> p._rescale(rows=1, verify_s=0.5, nodes=0, draft_s=0.0)  # a plain step took half the tuned time
        >>> p._scale, p.current_cost().verify_s(1)
        ([0.75, 1.0], 0.75)"""
        w, c = self.scale_weight, self.cost
        modelled = c.verify_s(rows)
        if modelled > 0 and verify_s > 0:
            self._scale[0] += w * (min(4.0, max(0.25, verify_s / modelled)) - self._scale[0])
        modelled = c.draft_fixed + c.draft_per_node * nodes
        if nodes > 0 and modelled > 0 and draft_s > 0:
            self._scale[1] += w * (min(4.0, max(0.25, draft_s / modelled)) - self._scale[1])
        used = self._scaled[0] if self._scaled is not None else (1.0, 1.0)
        if any(abs(s / u - 1.0) > self.rescale_step for s, u in zip(self._scale, used)):
            self._scaled = None
            self._best.clear()
            self._searched.clear()
            self._rules.clear()

    def current_cost(self) -> CostModel:
        if not self.learn_costs or not self._verify:
            if not self.scale_costs or self.learn_costs:
                return self.cost
            if self._scaled is None:
                sv, sd = self._scale
                c = self.cost
                self._scaled = ((sv, sd), CostModel(tuple((n, s * sv) for n, s in c.verify), c.draft_fixed * sd,
                                                    c.draft_per_node * sd))
            return self._scaled[1]
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


# -- per-node early stopping from calibrated confidence ---------------------------------------------------------
#
# A node's confidence is the drafter's probability of its path: the product of q's probability of each drafted
# token from depth 1 down to the node (greedy, where q is one-hot: the probability at temperature 1 that the
# drafter ranked by). `edgespec tune` measures how often a node of a given confidence is accepted (a
# Calibration); within a cycle, a drafter then keeps a node only while its expected gain (the probability that
# it is accepted, i.e. the tokens it adds on average) beats its marginal draft + verify cost at the rate the
# cycle is expected to earn. Stopping never changes the output's distribution as long as a SAMPLED node's fate
# is decided before its own draw is looked at (the draw may then be kept or dropped, but not because of its
# value): its expected gain is taken over q, E_{x~q}[cal(parent * q(x))]. A point-mass node (greedy, top-k,
# EAGLE-2's tree) is a function of the drafter's state, so its own confidence may decide it.

# finer towards 0: a path's confidence is a product, so deep or sampled nodes sit far below 0.1
CONF_EDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class Calibration:
    """P(a drafted node is accepted | its path confidence), as counts per confidence bin (`edges`), pulled by
    `prior_weight` pseudo-nodes per bin towards `prior` (a bin never seen is believed accepted at that rate, so
    that it gets drafted and measured: a drafter's q can be flat and still agree with a flat target), and made
    non-decreasing in confidence (a more confident path is never believed to be accepted less often).

    >>> c = Calibration(prior_weight=0.0)
    >>> c.observe([0.95, 0.97, 0.15, 0.12], [True, True, False, True])
    >>> round(float(c(0.975)), 3), round(float(c(0.15)), 3)  # bin centres: 0.95-1 took 2 of 2, 0.1-0.2 1 of 2
    (1.0, 0.5)"""
    edges: Tuple[float, ...] = CONF_EDGES
    drafted: List[float] = field(default_factory=list)  # [b]: nodes whose confidence fell in bin b
    accepted: List[float] = field(default_factory=list)  # [b]: ... and were accepted
    prior_weight: float = 1.0
    prior: float = 0.5
    _table: Optional[Tuple[List[float], List[float]]] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        bins = len(self.edges) - 1
        self.drafted = [float(x) for x in self.drafted] or [0.0] * bins
        self.accepted = [float(x) for x in self.accepted] or [0.0] * bins
        if len(self.drafted) != bins or len(self.accepted) != bins:
            raise ValueError(f"calibration: {bins} bins for {len(self.edges)} edges, got {len(self.drafted)} "
                             f"drafted and {len(self.accepted)} accepted counts")

    def observe(self, confidence: Sequence[float], accepted: Sequence[bool]) -> None:
        """One cycle's drafted nodes: their path confidences and whether each was accepted."""
        if len(confidence) == 0:
            return
        last, edges = len(self.drafted) - 1, self.edges
        for c, a in zip(confidence, accepted):  # a handful of nodes: bisect, not numpy's per-call cost
            b = min(max(bisect.bisect_right(edges, float(c)) - 1, 0), last)
            self.drafted[b] += 1.0
            self.accepted[b] += float(bool(a))
        self._table = None

    def merge(self, other: "Calibration") -> None:
        self.drafted = [a + b for a, b in zip(self.drafted, other.drafted)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]
        self._table = None

    def table(self) -> Tuple[List[float], List[float]]:
        """(bin centres, calibrated acceptance at each): non-decreasing (pool-adjacent-violators, by weight)."""
        if self._table is None:
            centres = [(a + b) / 2 for a, b in zip(self.edges, self.edges[1:])]
            w = self.prior_weight
            blocks: List[List[float]] = []  # [mean, weight, bins pooled]
            for c, n, k in zip(centres, self.drafted, self.accepted):
                blocks.append([(k + w * self.prior) / (n + w) if n + w > 0 else self.prior, n + w, 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    (m1, w1, b1), (m2, w2, b2) = blocks.pop(-2), blocks.pop()
                    blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2) if w1 + w2 > 0 else (m1 + m2) / 2, w1 + w2,
                                   b1 + b2])
            rates = [m for m, _, b in blocks for _ in range(int(b))]
            self._table = centres, rates
        return self._table

    def __call__(self, confidence):
        """Calibrated acceptance of a node of this path confidence (a float, or an array of them): linear between
        the bin centres, flat beyond the outer ones (np.interp's rule; a float is interpolated without numpy, the
        per-node rule asks once a node)."""
        xs, ys = self.table()
        if isinstance(confidence, np.ndarray):
            return np.interp(confidence, xs, ys)
        c = float(confidence)
        i = bisect.bisect_right(xs, c)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (c - x0) / (x1 - x0)

    def to_dict(self) -> Dict[str, List[float]]:
        return {"edges": list(self.edges), "drafted": [round(x, 3) for x in self.drafted],
                "accepted": [round(x, 3) for x in self.accepted]}

    @staticmethod
    def from_dict(d: Dict, where: str = "calibration") -> "Calibration":
        try:
            return Calibration(tuple(float(e) for e in d["edges"]), list(d["drafted"]), list(d["accepted"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: expected edges, drafted and accepted lists of numbers ({exc})") from None


@functools.lru_cache(maxsize=64)  # a policy's cost model moves only when a scale does: one hull per model
def marginal_verify(cost: CostModel, k_max: int) -> Tuple[float, ...]:
    """Seconds the (n + 1)-th drafted node adds to the verify, n = 0 .. k_max - 1, read off the lower convex hull
    of verify(1 .. k_max + 1): a one-off jump (on a CPU, 2 rows leave the matrix-vector path and cost far more
    than 1, then extra rows are nearly free) is spread over the nodes it buys instead of charged to the first, and
    a noisy point above the hull is ignored; where the curve is convex already (a GPU's), the hull is the curve.

    >>> marginal_verify(CostModel(((1, 1.0), (2, 1.6), (5, 1.9))), 4)  # hull 1.0 -> 1.9 over 4 rows, then flat
    (0.225, 0.225, 0.225, 0.225)
    >>> marginal_verify(CostModel(((1, 1.0), (3, 1.0), (5, 2.0))), 4)  # convex: free, free, then 0.5 a row
    (0.0, 0.0, 0.5, 0.5)"""
    pts = [(n, cost.verify_s(n)) for n in range(1, k_max + 2)]
    hull: List[Tuple[int, float]] = []
    for p in pts:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    slopes = []
    for (n0, s0), (n1, s1) in zip(hull, hull[1:]):
        slopes += [max(0.0, (s1 - s0) / (n1 - n0))] * (n1 - n0)
    return tuple(round(x, 12) for x in slopes)


def _cross(o, a, b) -> float:
    """> 0 when o -> a -> b turns left (a lies below the chord o-b: a stays on the lower hull)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True)
class NodeRule:
    """Whether the next drafted node pays: its expected gain g (tokens it adds on average) against its marginal
    cost, one more verify row plus one draft step, valued at `rate`, the tokens per second the cycle is expected
    to earn (the policy's best rate): keep it iff g >= rate * (verify(n + 2) - verify(n + 1) + draft_per_node)
    with n nodes kept so far. The drafter's fixed cost is sunk once it proposes, so it is not in the margin.

    >>> rule = NodeRule(CostModel(((1, 1.0), (2, 1.2))), Calibration(), rate=1.5)
    >>> rule.pays(0.4, 0), rule.pays(0.25, 0)  # the margin is 1.5 * 0.2 = 0.3 tokens
    (True, False)"""
    cost: CostModel
    calibration: Calibration
    rate: float  # expected tokens per second of the cycle (units of the cost model)
    # Marginal verify seconds of node n + 1 at [n] (`marginal_verify`); empty: read off the cost model directly
    slopes: Tuple[float, ...] = ()
    # [d-1]: how often the template's nodes at depth d were accepted (the product of its past cycles' conditional
    # acceptance, AcceptanceTracker): the floor of a SAMPLED node's gain. The calibration pools every template
    # and depth of a temperature class, and a sampled token's q says little of its fate (at T = 1 a chain the
    # target takes 4 tokens of was believed right ~1/3 of the time at every depth); depth, per template, does.
    reach: Tuple[float, ...] = ()

    @staticmethod
    def make(cost: CostModel, calibration: Calibration, rate: float, k_max: int,
             reach: Sequence[float] = ()) -> "NodeRule":
        return NodeRule(cost, calibration, rate, marginal_verify(cost, k_max), tuple(float(r) for r in reach))

    def margin(self, nodes: int) -> float:
        """Tokens the (nodes + 1)-th node must earn to pay for itself."""
        c = self.cost
        if self.slopes:
            row = self.slopes[min(nodes, len(self.slopes) - 1)]
        else:
            row = c.verify_s(nodes + 2) - c.verify_s(nodes + 1)
        return self.rate * (row + c.draft_per_node)

    def pays(self, gain: float, nodes: int) -> bool:
        return gain >= self.margin(nodes)

    def fixed_gain(self, path_confidence: float) -> float:
        """Expected gain of a point-mass node (its token is a function of the drafter's state) of this path
        confidence."""
        return float(self.calibration(path_confidence))

    def drawn_gain(self, parent_confidence: float, q: np.ndarray, depth: int = 0) -> float:
        """Expected gain of a SAMPLED node under `parent_confidence`, averaged over its proposal q (V,): it never
        reads the drawn token, so dropping the node is independent of the draw and the verifier stays exact.
        With its `depth` (1 = a child of the root) it is at least what the template's nodes at that depth were
        accepted at (`reach`), also history only.

        >>> cal = Calibration(prior_weight=0.0)
        >>> cal.observe([0.55, 0.95], [False, True])  # half-sure nodes were rejected, sure ones accepted
        >>> rule = NodeRule(CostModel(((1, 1.0),)), cal, rate=1.0)
        >>> rule.drawn_gain(1.0, np.array([0.5, 0.5])), round(rule.drawn_gain(1.0, np.array([0.025, 0.975])), 3)
        (0.0, 0.975)"""
        live = q[q > 0]
        gain = float(np.dot(live, self.calibration(parent_confidence * live)))
        if 0 < depth <= len(self.reach):
            gain = max(gain, self.reach[depth - 1])
        return gain

    def gain_bound(self, parent_confidence: float, depth: int = 0) -> float:
        """The most a child of a path of `parent_confidence` can be expected to gain, whatever it is drawn from:
        a certain token's calibrated gain (the calibration is non-decreasing, so `fixed_gain` and `drawn_gain` of
        any child are at most this) or, for a SAMPLED node at `depth` (0: none), the template's reach there. A
        level no frontier node's bound pays for is not run; with the reach counted, the step-wise chain stops
        where `keep_chain` cuts a K-step one.

        >>> rule = NodeRule(CostModel(((1, 1.0),)), Calibration(prior_weight=0.0), rate=1.0, reach=(0.9, 0.7))
        >>> rule.gain_bound(0.5), rule.gain_bound(0.5, depth=2)  # nothing observed: the prior 0.5; depth 2's reach
        (0.5, 0.7)"""
        gain = self.fixed_gain(parent_confidence)
        if 0 < depth <= len(self.reach):
            gain = max(gain, self.reach[depth - 1])
        return gain

    def keep_chain(self, qs: Sequence[np.ndarray], confidence: Sequence[float], deterministic: bool,
                   nodes: int = 0) -> int:
        """How many of a drafted chain's nodes to keep (nodes already kept before it: `nodes`). Node t is decided
        by the confidences of nodes < t and its own q; its own drawn confidence only when it is a point mass.

        >>> cal = Calibration(prior_weight=0.0)
        >>> cal.observe([0.85, 0.75, 0.25], [True, True, False])
        >>> rule = NodeRule(CostModel(((1, 1.0), (2, 1.2))), cal, rate=1.5)
        >>> rule.keep_chain([None] * 3, [0.9, 0.8, 0.3], deterministic=True)  # paths 0.9, 0.72, 0.216
        2"""
        parent = 1.0
        for t, c in enumerate(confidence):
            g = self.fixed_gain(parent * c) if deterministic else self.drawn_gain(parent, qs[t], nodes + t + 1)
            if not self.pays(g, nodes + t):
                return t
            parent *= c
        return len(confidence)
