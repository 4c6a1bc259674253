"""Adaptive draft shapes (runtime/speculation.py, `drafter.shape: adaptive`): each cycle's node budget comes from
the cost model and the acceptance seen so far. Greedy output stays token-identical to plain decoding for every
drafter, also across cycles that draft nothing and short probes; sampled output keeps the target's distribution
(chi-square, alpha 0.001, fixed seeds) with a wrong acceptance rule as the power control; and the rule drafts
nothing where drafting cannot pay."""
import os
from typing import Optional

import numpy as np
import pytest

from runtime.certify.run import certify
from runtime.sampling import SamplingParams
from runtime.serving.session import GenerationParams, Session
from runtime.speculation import AcceptanceTracker, AdaptivePolicy, Calibration, CostModel, best_depth
from runtime.text.prompts import action_prompt, planner_prompt
from runtime.tree import DraftTree
from tests.runtime.certify.test_certify import ALPHA, CONTEXT, always_accept
from tests.support import REPO_ROOT

ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")
PROMPTS = [planner_prompt("put two apples in the fridge"), action_prompt("lift the metal apple", [0.1] * 8),
           "<|bos|><|text|>To be, or not"]
DRAFTERS = ["draft_model", "ngram", "eagle", "eagle2", "eagle3", "eagle3_chain", "mtp", "dflash", "dflash2", "medusa"]


def skipping_policy(k_max: int = 4) -> AdaptivePolicy:
    """Verify rows that cost 60 % of a step each and a pessimistic prior: most cycles draft nothing, every third
    idle cycle probes two nodes (whatever a probe costs: no probe_share), and where the drafter is right the
    budget grows."""
    return AdaptivePolicy(CostModel(((1, 1.0), (2, 1.6))), k_max, probe_every=3, probe_depth=2, prior=0.3,
                          probe_share=None)


def needs_zoo():
    if not os.path.exists(os.path.join(ZOO, "bundle.yaml")):
        pytest.skip(f"{ZOO} is not built: run `make bundles`")


@pytest.mark.parametrize("backend", ["numpy_ref", "onnx"])
def test_adaptive_shapes_keep_greedy_output_identical_to_plain_decoding_for_every_drafter(backend):
    needs_zoo()
    plain = Session.open(ZOO, drafter="none", backend=backend)
    refs = [plain.generate(p, GenerationParams(max_tokens=40)).token_ids for p in PROMPTS]
    plain.close()
    for kind in DRAFTERS:
        s = Session.open(ZOO, drafter=kind, backend=backend)
        s.engine.policy = skipping_policy()
        skipped = drafted = 0
        for p, ref in zip(PROMPTS, refs):
            out = s.generate(p, GenerationParams(max_tokens=40))
            assert out.token_ids == ref, f"{kind} on {backend}: adaptive greedy output left plain decoding"
            skipped += out.stats.skipped_cycles
            drafted += out.stats.mean_budget > 0
        s.close()
        assert skipped > 0 and drafted == len(PROMPTS), f"{kind}: the test must cross plain steps and drafts"


def test_the_rule_drafts_nothing_where_the_drafter_is_rarely_right_and_probes_now_and_then():
    policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.3))), 4, probe_every=5, probe_depth=2, probe_share=None)
    for _ in range(40):  # the drafter's first token is accepted one time in ten
        policy.observe("action/greedy", 2, 0, 3, 1.3, 0.1)
    policy.observe("action/greedy", 2, 1, 3, 1.3, 0.1)
    budgets = [policy.budget("action/greedy") for _ in range(20)]
    assert budgets == [0, 0, 0, 0, 2] * 4
    # the planner's requests, where the same drafter is right, keep drafting: the state is per template
    for _ in range(20):
        policy.observe("planner/greedy", 4, 4, 5, 2.2, 0.1)
    assert policy.budget("planner/greedy") == 4


def test_the_best_depth_grows_as_verify_rows_get_cheaper():
    alphas = [0.8] * 8
    depths = [best_depth(alphas, CostModel(((1, 1.0), (2, 1.0 + row))), 8) for row in (1.0, 0.5, 0.2, 0.1, 0.02)]
    assert depths == sorted(depths) and depths[0] == 0 and depths[-1] == 8, depths


def test_acceptance_is_conditional_on_reaching_the_depth():
    t = AcceptanceTracker(prior_weight=0.0, decay=1.0)
    for accepted in (0, 0, 2, 2):  # four chains of 2: half stop at once, half take both
        t.observe(2, accepted)
    assert t.alphas(2) == [0.5, 1.0]


def test_adaptive_shapes_on_the_zoo_draft_where_it_pays_and_skip_where_it_does_not():
    """One CPU-like cost model (each verify row 50 % of a step): planner requests with the draft model (long
    accepted runs) draft every cycle; action tokens with the n-gram drafter (whose guesses the target rarely takes
    there) mostly run plain steps: cycles the rule skips, or whose nodes the per-node rule cuts to none (its misses
    cost a lookup, too little to veto the template: `realized_loss`)."""
    needs_zoo()
    s = Session.open(ZOO, drafter="draft_model")
    s.engine.policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.5))), 4, prior=0.5)
    for _ in range(3):
        out = s.generate(PROMPTS[0], GenerationParams(max_tokens=48))
    assert out.stats.shape == "adaptive" and out.stats.mean_budget >= 2 and out.stats.skipped_cycles == 0, out.stats
    s.close()
    s = Session.open(ZOO, drafter="ngram")
    s.engine.policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.5))), 4, prior=0.5)
    for _ in range(3):
        out = s.generate(PROMPTS[1], GenerationParams(max_tokens=48))
    assert out.stats.mean_nodes < 0.5, out.stats  # verify rows are not spent on its guesses
    s.close()


class Recording(AdaptivePolicy):
    """The real rule, remembering the shapes the cycles drafted as (depth, nodes), so the test can check that the
    shape really varied: the budget (0 or k_max) and the per-node rule's cuts below it."""

    def observe_nodes(self, key, confidence, accepted):
        self._nodes = len(confidence)
        super().observe_nodes(key, confidence, accepted)

    def observe(self, key, drafted, *rest):
        self.seen.add((drafted, getattr(self, "_nodes", 0) if drafted else 0))
        self._nodes = 0
        super().observe(key, drafted, *rest)


def varying_policy() -> Recording:
    p = Recording(CostModel(((1, 1.0), (2, 1.1), (3, 1.3), (4, 1.7))), 3, probe_every=2, probe_depth=1, prior=0.6)
    p.seen = set()
    return p


@pytest.mark.parametrize("drafter,branching,params", [
    ("draft_model", 1, SamplingParams(temperature=1.0)),
    ("draft_model", 2, SamplingParams(temperature=0.8)),
    ("ngram", 1, SamplingParams(temperature=1.0)),
])
def test_sampled_adaptive_shapes_pass_the_chi_square_test_through_the_real_drafter(tiny_bundle, drafter, branching,
                                                                                 params):
    s = Session.open(tiny_bundle, drafter=drafter, max_context=128)
    if branching > 1:
        s.drafter.branching = branching
    s.engine.policy = varying_policy()
    (res,) = certify(s, CONTEXT, params, draws=3000, alpha=ALPHA, seed=11)
    assert res.passed, res
    assert len(s.engine.policy.seen) > 1, "the shapes never varied: the test would not see a shape-dependent bias"


def test_the_chi_square_test_rejects_a_wrong_rule_under_adaptive_shapes(tiny_bundle):
    """Power control: the same run with a rule that accepts the first child whatever the target says."""
    s = Session.open(tiny_bundle, drafter="draft_model", max_context=128)
    s.engine.policy = varying_policy()
    (res,) = certify(s, CONTEXT, SamplingParams(temperature=1.0), draws=1500, alpha=ALPHA, verifier=always_accept)
    assert not res.passed and res.first_p_value < ALPHA
    assert np.isfinite(res.first_p_value)


def cut_by_own_draw(propose):
    """A WRONG per-node rule, the power control: it drops a sampled node (and its subtree) when its own draw is
    less likely under q than q's average draw, i.e. it decides a node by the value it drew. The real rule decides
    a sampled node on q alone, before the draw."""
    def wrapped(ctx):
        tree = propose(ctx)
        if not len(tree) or tree.q is None:
            return tree
        own = tree.q[np.arange(len(tree)), tree.tokens]
        dropped = np.zeros(len(tree), bool)
        for i, par in enumerate(tree.parents.tolist()):
            dropped[i] = (par >= 0 and dropped[par]) or own[i] < np.dot(tree.q[i], tree.q[i])
        keep = np.flatnonzero(~dropped)
        index = {int(n): j for j, n in enumerate(keep)}
        if not len(keep):
            return DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return DraftTree(tree.tokens[keep], [index[int(p)] if p >= 0 else -1 for p in tree.parents[keep]],
                         q=tree.q[keep], deterministic=tree.deterministic[keep])
    return wrapped


@pytest.mark.parametrize("branching", [1, 2])
@pytest.mark.parametrize("wrong", [False, True])
def test_the_per_node_rule_keeps_the_target_law_and_one_deciding_a_sampled_node_by_its_draw_does_not(
        tiny_bundle, branching, wrong):
    """Chains and trees, sampled, chi-square at alpha 0.001 over 6000 draws (fixed seed): the real per-node rule
    passes, and the same run with the power control on top (a node dropped when its own draw was unlikely under
    q, a bias of about 0.06 in total variation at the first token here) fails."""
    s = Session.open(tiny_bundle, drafter="draft_model", max_context=128)
    s.drafter.branching = branching
    # verify rows nearly free: the real rule keeps most nodes, so the wrong cut, where on, decides the shape
    s.engine.policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.01), (4, 1.03))), 3, prior=0.9)
    if wrong:
        s.drafter.propose = cut_by_own_draw(s.drafter.propose)
    (res,) = certify(s, CONTEXT, SamplingParams(temperature=1.0), draws=6000, alpha=ALPHA, seed=11)
    assert res.passed != wrong, res
    if wrong:
        assert min(res.first_p_value, res.pair_p_value) < ALPHA


class Scrambled:
    """The target with every output logit row shuffled: the same cache, positions and taps, other answers."""

    def __init__(self, target, peeked):
        self.t, self.peeked = target, peeked

    def __getattr__(self, name):
        return getattr(self.t, name)

    def forward(self, tokens, positions, mask=None, taps=(), all_logits=True):
        res = self.t.forward(tokens, positions, mask, taps, all_logits)
        res.logits = res.logits[:, ::-1].copy()
        self.peeked.append(len(tokens))
        return res


def first_cycle_tree(session, prompt_ids, scrambled: bool, peek_rule: bool = False):
    """The tree the first cycle drafts after `prompt_ids` (its root fixed), the target scrambled or not."""
    eng = session.engine
    real = eng.target
    peeked = []
    if scrambled:
        eng.target = Scrambled(real, peeked)
    trees = []
    propose = session.drafter.propose

    def recording(ctx):
        tree = propose(ctx)
        if peek_rule:  # the control: a rule that sizes the chain by what the target says after the root
            out = eng.target.forward(np.asarray([ctx.tokens[-1]]), np.asarray([len(ctx.tokens) - 1]))
            eng.target.keep(len(ctx.tokens) - 1, [])
            n = int(np.argmax(out.logits[0])) % (len(tree) + 1)
            tree = DraftTree(tree.tokens[:n], tree.parents[:n], None if tree.q is None else tree.q[:n],
                             tree.deterministic[:n])
        trees.append(tree)
        return tree

    session.drafter.propose = recording
    try:
        eng.policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.1), (3, 1.3), (4, 1.7))), 3, prior=0.6)
        eng.generate(prompt_ids, SamplingParams(temperature=1.0), max_tokens=8, seed=3, first_token=int(prompt_ids[-1]))
    finally:
        del session.drafter.propose
        eng.target = real
    return trees[0]


@pytest.mark.parametrize("peek", [False, True])
def test_a_cycles_draft_shape_never_depends_on_the_targets_outputs_for_that_cycle(tiny_bundle, peek):
    """The per-node rule decides from the drafter's side only (q, its confidences, the cost model): the first
    cycle drafts the same tree against the target and against one whose every logit row is scrambled. The
    control, a rule that asks the target whether to keep the first node, drafts differently: the test sees it."""
    s = Session.open(tiny_bundle, drafter="draft_model", max_context=128)
    ids = s.tokenizer.encode(CONTEXT[0])
    trees = []
    for scrambled in (False, True):
        tree = first_cycle_tree(s, ids, scrambled, peek)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
    s.close()
    if peek:
        assert trees[0] != trees[1], "the control rule peeked at the target and should have drafted differently"
    else:
        assert trees[0] == trees[1] and len(trees[0][0]) > 0, trees


def run_idle_template(policy: AdaptivePolicy, key: str, cycles: int, accepted: int = 0) -> int:
    """`cycles` cycles of a template whose drafts get `accepted` tokens each; returns how many drafted."""
    drafted = 0
    for _ in range(cycles):
        b = policy.budget(key)
        if b:
            drafted += 1
        policy.observe(key, b, min(b, accepted), b + 1, 1.0, 0.1)
    return drafted


def test_each_probe_that_does_not_pay_doubles_the_wait_before_the_next_one():
    """A probe costs a catch-up on every token since the drafter last ran, so a template where drafting never
    pays is probed ever more rarely (after 16, 32, 64, 128, 256 cycles, then every 256): 5 probes in 600 cycles, not 37."""
    policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.5))), 4, probe_every=16, probe_max=256, prior=0.1,
                            probe_share=None)  # (the wait by the doubling rule alone: see the next test)
    assert run_idle_template(policy, "action/greedy", 600) == 5
    assert policy.interval["action/greedy"] == 256
    # where drafting pays again, the first probe taken whole brings the short interval back, and drafting follows
    assert run_idle_template(policy, "action/greedy", 600, accepted=4) > 300
    # (a drafting template's wait is set when it next drafts nothing: the probe_wait of then)
    assert policy.interval.get("action/greedy", policy.probe_wait("action/greedy")) == 16


def test_probes_never_take_more_than_their_share_of_a_templates_time():
    """Whatever the doubling rule says, a probe that costs c plain steps beyond the step it replaces is followed by
    at least c / probe_share idle cycles (2 % here), by what the template's last probe was timed at. Here each
    probe is taken whole, which would bring the wait back to 16 cycles, but costs 3 steps over a plain one (its
    catch-up and verify rows; drafting never pays at these costs): after the first (at 16), one per 150 cycles,
    not one per 17."""
    policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 2.0)), draft_fixed=1.0), 4, probe_every=16, prior=0.1,
                            probe_share=0.02)
    probes = []
    for cycle in range(600):
        b = policy.budget("action/greedy")
        if b:
            probes.append(cycle)
        policy.observe("action/greedy", b, b, b + 1, 3.0 if b else 1.0, 1.0 if b else 0.0)  # taken whole
    assert probes == [15, 165, 315, 465], probes
    # probes measured cheaper (half a step over a plain one) may come sooner: 25 cycles, as the cost allows
    for _ in range(151):
        b = policy.budget("action/greedy")
        policy.observe("action/greedy", b, b, b + 1, 1.2 if b else 1.0, 0.3 if b else 0.0)
    assert policy.interval["action/greedy"] == 25


def test_a_tuned_templates_first_probe_waits_what_the_cost_model_says_a_probe_costs():
    """A tuned policy knows what a probe costs before it takes one (the tune measured the drafter and the verify
    rows here), so its first probe in a template that does not pay keeps to probe_share too: drafting 2 nodes at
    1.0 + 2 x 0.5 plus two extra verify rows at 0.5 is 3 steps over a plain one, so at 2 % the first probe comes
    after 150 idle cycles, not after probe_every's 16. An untuned policy (the control) probes at 16."""
    def first_probe(**kw) -> int:
        policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.5)), draft_fixed=1.0, draft_per_node=0.5), 4,
                                probe_every=16, prior=0.1, probe_share=0.02, **kw)
        for cycle in range(400):
            b = policy.budget("action/greedy")
            if b:
                return cycle
            policy.observe("action/greedy", b, 0, 1, 1.0, 0.0)
        return -1

    assert first_probe(first_probe_from_cost=True) == 149
    assert first_probe() == 15


# A drafter with a high fixed cost: 4 nodes accepted whole earn 5 tokens in 1.4 + 1.6 + 0.8 = 3.8 steps (1.3x),
# 2 nodes 3 tokens in 1.2 + 1.6 + 0.4 = 3.2 (0.94x: below the veto's 0.97)
HIGH_FIXED_COST = CostModel(((1, 1.0), (5, 1.4)), draft_fixed=1.6, draft_per_node=0.2)


def high_fixed_cost_policy() -> AdaptivePolicy:
    return AdaptivePolicy(HIGH_FIXED_COST, 4, per_node=False, probe_every=16, prior=0.95, probe_share=None)


def drafting_cycles_after_a_slow_spell(accepted_after: bool) -> int:
    """Five drafting cycles timed at 20 plain steps each (a slow spell: a drafter's first-run allocations, a busy
    CPU) veto a template whose drafts are all accepted; then 300 cycles at the cost model's own timings, the
    drafts accepted whole (`accepted_after`) or never. Returns how many of the last 100 cycles drafted."""
    cost, policy, key = HIGH_FIXED_COST, high_fixed_cost_policy(), "planner/greedy"
    for _ in range(5):  # (realized_min: four cycles of evidence, decayed by 0.9 a cycle)
        b = policy.budget(key)
        assert b == 4  # planned: 4 nodes, each accepted
        policy.observe(key, b, b, b + 1, 20.0, 0.0)
    assert policy.budget_depth(key) == 0, "the slow spell must veto the template for this test to mean anything"
    drafted = []
    for _ in range(300):
        b = policy.budget(key)
        draft_s = cost.draft_fixed + cost.draft_per_node * b if b else 0.0
        policy.observe(key, b, b if accepted_after else 0, b + 1, cost.verify_s(b + 1), draft_s)
        drafted.append(b > 0)
    return sum(drafted[-100:])


def cycles_before_a_veto(miss_s: float, verify_s: float = 1.0, **kw) -> Optional[int]:
    """Cycles a template plans to draft through while every proposal comes back empty (an n-gram drafter early in a
    request: no match yet), each costing `miss_s` of looking and a 1-row verify timed at `verify_s` (a plain
    step: 1.0); None: never vetoed in 40."""
    policy, key = AdaptivePolicy(CostModel(((1, 1.0), (5, 1.4)), draft_fixed=miss_s), 4, probe_share=None,
                                 prior=0.9, **kw), "text/greedy"
    for cycle in range(40):
        b = policy.budget(key)
        if b == 0:
            return cycle
        policy.observe(key, 0, 0, 1, verify_s, miss_s)  # proposed, nothing drafted: one token for 1 + miss_s steps
    return None


def test_a_veto_needs_a_loss_worth_it_so_a_drafter_whose_misses_are_nearly_free_keeps_looking():
    """Empty proposals at 5 % of a step each run at 0.95x plain (below the 0.97 floor) but lose less than the 10 % of
    a step a cycle that `realized_loss` asks of a veto: the template keeps drafting, so the matches that come later
    in a request are proposed. Control: misses at 60 % of a step veto it as soon as their evidence counts (four
    cycles, decayed); and without the loss rule (the floor alone) so do the nearly free misses."""
    assert cycles_before_a_veto(0.05) is None
    assert cycles_before_a_veto(0.05, verify_s=1.25) is None  # a plain step's verify, timed slow: it is one step
    assert 4 <= cycles_before_a_veto(0.6) <= 6
    assert cycles_before_a_veto(0.05, realized_loss=0.0) == 5  # (four cycles of evidence, decayed 0.9 a cycle)


def vetoed_by_one_outlier(**kw) -> bool:
    """A template that pays, barely (the n-gram drafter on the zoo's planner prompts): one cycle in three drafts 2
    nodes and lands 1 (2 tokens for the model's 1.2 + 0.1 steps), two find no match (1 token for 1.05 steps); then
    one drafting cycle's verify is timed at 5 plain steps (on the zoo a 1-row verify once took 5.2 steps: a context
    switch, a collection). Is the template vetoed within the next 15 cycles?"""
    policy, key = AdaptivePolicy(CostModel(((1, 1.0), (3, 1.2)), draft_fixed=0.05, draft_per_node=0.025), 4,
                                 per_node=False, probe_share=None, prior=0.9, scale_costs=False, **kw), "planner/greedy"
    for cycle in range(45):
        policy.budget(key)
        if key in policy._vetoed:
            return True
        if cycle % 3 == 0:
            policy.observe(key, 2, 1, 3, 5.0 if cycle == 30 else 1.2, 0.1)
        else:
            policy.observe(key, 0, 0, 1, 1.0, 0.05)
    return False


def test_one_slow_cycle_does_not_veto_a_template_that_pays():
    """A cycle's timing counts at most twice what the cost model says its shape costs (`realized_clip`), so one
    outlier among cycles that pay leaves the template drafting through the empty proposals that follow. Control:
    taken as timed, the same outlier vetoes it."""
    assert not vetoed_by_one_outlier()
    assert vetoed_by_one_outlier(realized_clip=float("inf"))


def test_a_template_vetoed_by_a_slow_spell_drafts_again_once_its_drafts_pay():
    """The veto reads the drafting cycles' timed seconds, so a slow spell vetoes a template whose drafts all land.
    Its probes then draft the shape it planned (not two nodes, which cannot show that four pay: with short probes
    this template stayed at plain steps for good), timed at the cost model: drafting comes back. Control: where the
    drafts stop landing, the template stays at plain steps."""
    assert drafting_cycles_after_a_slow_spell(accepted_after=True) >= 95
    assert drafting_cycles_after_a_slow_spell(accepted_after=False) <= 10


def test_a_template_whose_drafts_keep_timing_slow_is_retried_ever_more_rarely():
    """The other side of re-trying a vetoed template's planned shape: where its probes pay at the cost model but
    its drafting cycles keep timing slow (20 plain steps), each lift of the veto that does not hold doubles the
    wait before the next probe, so in 1000 cycles only a few dozen draft."""
    policy, key, drafted = high_fixed_cost_policy(), "planner/greedy", 0
    for _ in range(1000):
        b = policy.budget(key)
        drafted += b > 0
        policy.observe(key, b, b, b + 1, 20.0 if b else 1.0, 0.0)
    assert drafted <= 60, drafted


def test_a_probe_drafts_its_nodes_whole_and_a_plain_step_builds_no_node_rule():
    """A probe is there to measure its nodes (its catch-up is paid anyway), so no per-node rule cuts it; and the
    engine builds no rule at all for a cycle that drafts nothing."""
    policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.5))), 4, probe_every=3, prior=0.1, probe_share=None)
    budgets = [policy.budget("text/greedy") for _ in range(3)]
    assert budgets == [0, 0, 2] and policy.node_rule("text/greedy") is None
    needs_zoo()

    class Counting(AdaptivePolicy):
        rules = drafting = 0

        def budget(self, key):
            b = super().budget(key)
            Counting.drafting += b > 0
            return b

        def node_rule(self, key):
            Counting.rules += 1
            return super().node_rule(key)

    s = Session.open(ZOO, drafter="ngram")
    s.engine.policy = Counting(CostModel(((1, 1.0), (2, 1.6))), 4, probe_every=3, prior=0.05, probe_share=None)
    out = s.generate(PROMPTS[1], GenerationParams(max_tokens=24))
    s.close()
    assert out.stats.skipped_cycles > 0 and 0 < Counting.rules == Counting.drafting, out.stats


def test_a_sampled_node_keeps_the_depth_its_template_has_earned_when_the_calibration_says_little():
    """At T = 1 a drafted token's q says little of its fate: the pooled calibration believed every sampled node
    right ~1/3 of the time, so MTP's chains were cut at once where the template's first node was accepted 9 times
    in 10. The node's depth, per template (history only), floors its gain."""
    policy = AdaptivePolicy(CostModel(((1, 1.0), (2, 1.1), (5, 1.4)), draft_per_node=0.05), 4, prior=0.5)
    flat = Calibration(prior_weight=0.0)
    flat.observe([0.01, 0.2, 0.5, 0.9] * 30, [True, False, False] * 40)  # ~1/3 at every confidence
    policy.calibrations["sampled"] = flat
    for _ in range(50):
        policy.observe("text/sampled", 4, 4 if np.random.default_rng(_).random() < 0.9 else 0, 5, 1.4, 0.1)
    assert policy.budget("text/sampled") > 0
    rule = policy.node_rule("text/sampled")
    q = np.full(64, 1 / 64)  # a flat proposal: its draw's own confidence is tiny
    assert rule.drawn_gain(1.0, q) < rule.margin(0)  # by the calibration alone: cut
    assert rule.drawn_gain(1.0, q, depth=1) >= rule.margin(0)  # by what depth 1 earned here: kept


def test_a_template_whose_drafts_the_node_rule_cuts_to_nothing_goes_back_to_plain_steps():
    """The tune believed the template's chains pay (alphas 0.9), but in its cycles the per-node rule keeps no node
    after the drafter's fixed cost is paid (a step's worth here): what those cycles earned, not the plan, decides,
    and after a few the template drafts nothing but probes."""
    from runtime.serving.tuning import seeded_tracker
    policy = AdaptivePolicy(CostModel(((1, 1.0), (5, 1.2)), draft_fixed=1.0, draft_per_node=0.02), 4,
                            probe_every=16)
    policy.trackers["text/greedy"] = seeded_tracker([0.9] * 4, 8)
    budgets = []
    for _ in range(40):
        b = policy.budget("text/greedy")
        budgets.append(b)
        if b:
            policy.observe_nodes("text/greedy", [], [])  # the rule kept none of the budget's nodes
        policy.observe("text/greedy", 0, 0, 1, 1.0, 1.0)
    assert budgets[0] == 4 and budgets[10:].count(0) >= 29, budgets


@pytest.mark.parametrize("scale_costs", [True, False])
def test_a_tune_that_over_states_the_verify_cost_is_corrected_by_the_cycles_own_timings(scale_costs):
    """The tune timed a step at 1.0 (another context length, another process); here every verify takes half what
    it said. Under the tune's costs a one-node draft right half the time pays (1.5 tokens in 1.3 steps); at the
    measured verify it does not (1.5 tokens in 0.775 where a plain step takes 0.5): after the cycles' timings have
    moved the scale, the template drafts nothing but probes. With the scaling off (the control) it drafts on."""
    from runtime.serving.tuning import seeded_tracker
    cost = CostModel(((1, 1.0), (5, 1.2)), draft_per_node=0.25)
    policy = AdaptivePolicy(cost, 4, per_node=False, probe_every=16, scale_costs=scale_costs)
    policy.trackers["text/greedy"] = seeded_tracker([0.5] * 4, 8)
    budgets = []
    for cycle in range(120):
        b = policy.budget("text/greedy")
        budgets.append(b)
        policy.observe("text/greedy", b, cycle % 2 if b else 0, b + 1, 0.5 * cost.verify_s(b + 1), 0.25 * b)
    assert budgets[0] == 1  # the tune's plan
    if scale_costs:
        assert budgets[60:].count(0) >= 55 and policy.current_cost().verify_s(1) == pytest.approx(0.5, abs=0.03)
    else:
        assert budgets[60:].count(0) == 0
