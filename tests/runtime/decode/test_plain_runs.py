"""Runs of plain steps (AdaptivePolicy.plain_run / skip, Engine's PlainRun): where the adaptive rule has decided
that a template's next cycles draft nothing (no probe is due), the engine runs them as plain steps without asking
the rule each cycle and tells it once. The rule ends where asking it every cycle would have left it; the output
stays token-identical to plain decoding; a drafter that reads the target's taps still sees every committed row."""
import doctest

import pytest

from runtime import speculation
from runtime.serving.session import GenerationParams, Session
from runtime.speculation import AdaptivePolicy, CostModel
from tests.runtime.decode.test_adaptive_shapes import DRAFTERS, PROMPTS, ZOO, needs_zoo

KEY = "action/greedy"


def idle_policy(probe_every: int = 10, prior: float = 0.3) -> AdaptivePolicy:
    """Verify rows at 60 % of a step and a pessimistic prior: the rule drafts nothing but its probes."""
    return AdaptivePolicy(CostModel(((1, 1.0), (2, 1.6))), 4, probe_every=probe_every, probe_depth=2, prior=prior,
                          probe_share=None)


def drive(policy: AdaptivePolicy, cycles: int, batched: bool) -> list:
    """`cycles` cycles of a template whose drafts are never accepted, plain steps timed at 0.7-0.9 of the modelled
    step (so the verify cost scale moves, unevenly) and probes at 2.5; batched = the engine's pattern (ask once,
    then a plain run told by `skip`), else `budget` and `observe` every cycle. Returns the cycles that probed."""
    probes, left, run = [], 0, []
    for cycle in range(cycles):
        seconds = 0.7 + 0.1 * (cycle % 3)
        if batched and left > 0:
            left -= 1
            run.append(seconds)
            continue
        policy.skip(KEY, run)
        run = []
        b = policy.budget(KEY)
        if b:
            probes.append(cycle)
        policy.observe(KEY, b, 0, b + 1, 2.5 if b else seconds, 0.5 if b else 0.0)
        if batched and not b:
            left = policy.plain_run(KEY)
    policy.skip(KEY, run)
    return probes


def test_a_run_of_plain_steps_leaves_the_rule_where_asking_it_every_cycle_would():
    asked, batched = idle_policy(), idle_policy()
    probes = drive(asked, 700, batched=False)
    assert len(probes) >= 4, "the test must cross several probes and their doubling waits"
    assert drive(batched, 700, batched=True) == probes
    assert (batched.idle, batched.interval, batched.skipped, batched.probes) == \
        (asked.idle, asked.interval, asked.skipped, asked.probes)
    assert batched._scale == pytest.approx(asked._scale, rel=1e-12) and asked._scale[0] < 0.9


def test_a_plain_run_stops_short_of_the_next_probe_and_of_its_bound():
    policy = idle_policy(probe_every=10)
    assert policy.budget(KEY) == 0 and policy.plain_run(KEY) == 8  # idle 1 of 10: the 10th cycle probes
    assert policy.plain_run(KEY, most=5) == 5
    never = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.6))), 4, probe_every=0, prior=0.3)
    assert never.budget(KEY) == 0 and never.plain_run(KEY) == never.plain_run_most == 64  # the default bound
    learning = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.6))), 4, prior=0.3, learn_costs=True)
    assert learning.budget(KEY) == 0 and learning.plain_run(KEY) == 0  # it learns from every cycle's timing


def test_the_shape_rules_worked_examples_hold():
    assert doctest.testmod(speculation).failed == 0


class Counting(AdaptivePolicy):
    asked = 0

    def budget(self, key):
        Counting.asked += 1
        return super().budget(key)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_plain_runs_keep_greedy_output_identical_and_every_tap_reader_in_step(kind):
    """Probes every 10 cycles and plain runs between them, on the ONNX backend: each drafter's greedy output equals
    plain decoding's (an EAGLE, MTP or DFlash drafter that missed a committed row fails loudly, out of step), and
    the rule is asked about a quarter of the cycles, not each one."""
    needs_zoo()
    plain = Session.open(ZOO, drafter="none")
    refs = [plain.generate(p, GenerationParams(max_tokens=40)).token_ids for p in PROMPTS]
    plain.close()
    s = Session.open(ZOO, drafter=kind)
    s.engine.policy = Counting(CostModel(((1, 1.0), (2, 1.6))), 4, probe_every=10, probe_depth=2, prior=0.05,
                               probe_share=None)
    Counting.asked = cycles = skipped = 0
    for p, ref in zip(PROMPTS, refs):
        out = s.generate(p, GenerationParams(max_tokens=40))
        assert out.token_ids == ref, f"{kind}: greedy output left plain decoding across plain runs"
        cycles, skipped = cycles + out.stats.cycles, skipped + out.stats.skipped_cycles
    s.close()
    assert skipped > cycles / 2, "the test must run mostly plain steps"
    assert Counting.asked < cycles / 3, (Counting.asked, cycles)


@pytest.mark.parametrize("kind", ["mtp", "eagle", "dflash2"])
def test_a_tap_reader_hears_each_committed_row_once_and_in_order_also_where_a_request_ends_inside_a_run(kind):
    """A drafter that reads the target's taps is told every committed token with its tap row, in context order:
    runs are told in one accept when they end, and a request that reaches max_tokens inside a run tells the run
    before its last cycle (told after it, MTP's rows sat out of order, and the next request reused them)."""
    needs_zoo()
    s = Session.open(ZOO, drafter=kind)
    s.engine.policy = idle_policy(prior=0.05)
    heard, real = [], s.drafter.accept

    def accept(nodes, committed, taps):
        assert {len(rows) for rows in taps.values()} == {len(committed)}, "one tap row per committed token"
        heard.extend(int(t) for t in committed)
        real(nodes, committed, taps)

    s.drafter.accept = accept
    try:
        for max_tokens in (20, 27, 33):
            heard.clear()
            ids = s.generate(PROMPTS[1], GenerationParams(max_tokens=max_tokens)).token_ids
            n = min(len(ids), len(heard))
            assert heard[:n] == ids[:n] and len(heard) >= len(ids) - 1, (max_tokens, heard, ids)
    finally:
        del s.drafter.accept
        s.close()
