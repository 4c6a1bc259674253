"""Per-node early stopping (runtime/speculation.py NodeRule, Calibration): a chain stops at an uncertain token,
EAGLE-2's dynamic tree keeps the nodes it earns, a DFlash block is cut where its slots stop paying; the
calibration is monotone in confidence and round-trips through tune.yaml's form."""
from types import SimpleNamespace

import numpy as np

from runtime.drafters.eagle import DynamicTree, dynamic_tree
from runtime.drafters.shared import grow_chains
from runtime.sampling import SamplingParams
from runtime.speculation import Calibration, CostModel, NodeRule


def sharp_calibration() -> Calibration:
    """A drafter whose sure tokens (path confidence > 0.5) are accepted and whose unsure ones are not."""
    c = Calibration(prior_weight=0.0)
    c.observe([0.05, 0.25, 0.45, 0.55, 0.75, 0.97], [False, False, False, True, True, True])
    return c


def rule(row_cost: float = 0.2, rate: float = 1.5) -> NodeRule:
    return NodeRule(CostModel(((1, 1.0), (2, 1.0 + row_cost))), sharp_calibration(), rate)


def chain_ctx(stop):
    return SimpleNamespace(params=SamplingParams(), rng=np.random.default_rng(0), mask=lambda path=(): None,
                           stop=stop, wants_confidence=True)


def test_a_greedy_chain_stops_at_the_first_token_the_drafter_is_unsure_of():
    # After token t the drafter puts its mass on t + 1: sure (0.9) up to token 2, then torn between two tokens.
    V = 8
    sure = np.log(np.asarray([0.9] + [0.1 / (V - 1)] * (V - 1)))
    torn = np.log(np.asarray([0.45, 0.45] + [0.1 / (V - 2)] * (V - 2)))
    runs = []

    def run(frontier, tokens, parents, d):
        runs.append(d)
        last = tokens[frontier[0]]
        return np.stack([np.roll(sure if last < 2 else torn, last + 1)])

    tree = grow_chains(chain_ctx(rule()), [7], np.roll(sure, 0), 1, 6, None, run)
    assert tree.tokens.tolist() == [0, 1, 2], tree.tokens  # 0.9, 0.81, 0.73 pay; 0.73 * 0.45 = 0.33 does not
    assert np.allclose(tree.confidence, [0.9, 0.81, 0.729])
    unstopped = grow_chains(chain_ctx(None), [7], np.roll(sure, 0), 1, 6, None, run)
    assert len(unstopped) == 6


def test_a_chain_is_not_run_further_when_even_a_certain_token_could_not_pay():
    V = 4
    unsure = np.log(np.asarray([0.4, 0.3, 0.2, 0.1]))
    runs = []

    def run(frontier, tokens, parents, d):
        runs.append(d)
        return np.stack([unsure])

    tree = grow_chains(chain_ctx(rule()), [3], unsure, 1, 6, None, run)
    assert len(tree) == 0 and runs == [], "the root's own pick (0.4) cannot pay, and nothing below it is run"


def test_eagle2s_dynamic_tree_gets_the_node_budget_it_earns():
    # Root: a (0.9) b (0.1); under a: c (0.8 -> path 0.72), d (0.2 -> 0.18); under b: e, f (paths 0.05 each).
    rows = {0: {2: 0.8, 3: 0.2}, 1: {4: 0.5, 5: 0.5}}

    def logp(d):
        out = np.full(8, -np.inf)
        for t, v in d.items():
            out[t] = np.log(v)
        return out

    def expand(frontier, tokens, parents):
        return [logp(rows.get(tokens[n], {})) for n in frontier]

    full, _, _ = dynamic_tree(expand, logp({0: 0.9, 1: 0.1}), DynamicTree(60, 2, 2), 100)
    tokens, parents, conf = dynamic_tree(expand, logp({0: 0.9, 1: 0.1}), DynamicTree(60, 2, 2), 100, rule())
    assert len(full) == 6 and (tokens, parents) == ([0, 2], [-1, 0]), (tokens, parents)
    assert np.allclose(conf, [0.9, 0.72])
    # a drafter accepted 30 % of the time whatever its confidence, where verify rows cost almost nothing: all 6
    flat = NodeRule(CostModel(((1, 1.0), (2, 1.001))), Calibration(prior=0.3), rate=1.5)
    assert len(dynamic_tree(expand, logp({0: 0.9, 1: 0.1}), DynamicTree(60, 2, 2), 100, flat)[0]) == 6


def test_a_block_of_drafted_slots_is_cut_where_they_stop_paying():
    r = rule()
    # greedy slots: own confidences 0.95, 0.9, 0.6 -> paths 0.95, 0.855, 0.51 (pays: 0.51 > 0.5), 0.3 -> 0.15
    assert r.keep_chain([None] * 4, [0.95, 0.9, 0.6, 0.3], deterministic=True) == 3
    # a sampled slot is decided on its q and the slots before it, never on its own draw: whatever the second slot
    # drew, it is cut the same way (q (0.3, 0.3, 0.4) after a 0.98 draw: paths of 0.29 to 0.39, never accepted)
    qs = [np.asarray([0.98, 0.02]), np.asarray([0.3, 0.3, 0.4])]
    assert r.keep_chain(qs, [0.98, 0.4], deterministic=False) == r.keep_chain(qs, [0.98, 0.3], deterministic=False) == 1


def test_the_calibration_never_believes_a_surer_path_is_accepted_less_often():
    c = Calibration(prior_weight=0.0)
    c.observe([0.15, 0.15, 0.35, 0.35, 0.65], [True, True, False, False, True])  # a noisy middle
    _, rates = c.table()
    assert rates == sorted(rates)
    back = Calibration.from_dict(c.to_dict())
    assert back.drafted == c.drafted and back.accepted == c.accepted


def test_a_cpus_one_off_jump_to_two_verify_rows_is_spread_over_the_nodes_it_buys():
    """On a CPU a 2-row verify leaves the matrix-vector path (here +0.6 step), then more rows are nearly free: a
    rule charging the whole jump to the first node would never draft there; read off the cost's lower convex
    hull, four nodes the calibration says are always accepted pay (0.45 tokens a node at 2 tokens/step, where the
    first node alone would have to earn 1.2)."""
    cost = CostModel(((1, 1.0), (2, 1.6), (5, 1.9)))
    cal = Calibration(prior_weight=0.0)
    cal.observe([0.05, 0.97, 0.85, 0.75, 0.65], [False, True, True, True, True])
    naive = NodeRule(cost, cal, rate=2.0)
    hull = NodeRule.make(cost, cal, rate=2.0, k_max=4)
    assert naive.keep_chain([None] * 4, [0.9] * 4, deterministic=True) == 0
    assert hull.keep_chain([None] * 4, [0.9] * 4, deterministic=True) == 4
