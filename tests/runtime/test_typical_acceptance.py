"""Medusa's typical acceptance: a LOSSY rule behind `decoding.lossy_typical_acceptance`, off by default.

What is proven: the default session verifies by exact rejection sampling; with the option on, the engine accepts
exactly what the rule p(x) > min(epsilon, delta * exp(-H(p))) says (longest passing path); the rule is NOT exact
(first-token chi-square against the target's law rejects it with the real Medusa drafter, alpha = 0.001,
1500 draws, fixed seeds, while the exact rule passes the same test in the same context: the control); certify
refuses a lossy session, from the API and from the command line."""
import numpy as np
import pytest

from runtime.certify.run import certify
from runtime.config import RuntimeConfig, override
from runtime.errors import ConfigError
from runtime.sampling import SamplingParams
from runtime.serving.session import Session
from runtime.tree import DraftTree
from runtime.verify import verify_sampled
from runtime.verify_typical import lossy_verifier, typical_accepts, typical_threshold, verify_typical_lossy
from tests.runtime.drafters.test_medusa_drafter import PARAMS, most_sensitive_prompts, tiny_session

ALPHA = 1e-3
DRAWS = 1500


def test_typical_acceptance_is_off_by_default(tiny_bundle):
    assert RuntimeConfig().decoding.lossy_typical_acceptance is False
    assert Session.open(tiny_bundle, drafter="draft_model", max_context=64).engine.sampled_verifier is verify_sampled


def test_lossy_option_puts_the_typical_rule_in_the_engine(tiny_bundle):
    cfg = override(RuntimeConfig(bundle=tiny_bundle), "decoding.lossy_typical_acceptance", True)
    cfg = override(cfg, "memory.max_context", 64)
    rule = Session(cfg).engine.sampled_verifier
    assert rule.lossy and rule.func is verify_typical_lossy
    assert rule.keywords == {"epsilon": 0.09, "delta": 0.3}  # Medusa's published defaults


def test_threshold_is_min_of_epsilon_and_entropy_scaled_delta():
    assert typical_threshold(np.array([0.5, 0.5])) == pytest.approx(0.09)  # 0.3 * 0.5 = 0.15 > 0.09
    assert typical_threshold(np.full(4, 0.25)) == pytest.approx(0.075)  # 0.3 / 4
    assert typical_threshold(np.array([1.0, 0.0])) == pytest.approx(0.09)  # H = 0
    p = np.array([0.5, 0.42, 0.08])
    assert typical_accepts(p, 1) and not typical_accepts(p, 2)


def test_lossy_verifier_keeps_the_longest_passing_path_and_samples_the_row_after_it():
    V = 10
    rows = np.full((4, V), 0.01)
    rows[0, 3], rows[0, 5] = 0.4, 0.5  # root: tokens 3 (node 0) and 5 (node 1) both pass
    rows[1, 7] = 0.6  # after node 0: token 7 (node 2) passes
    rows[3, 9] = 0.9  # after node 2: the next token is drawn here
    rows /= rows.sum(1, keepdims=True)
    tree = DraftTree(tokens=np.array([3, 5, 7]), parents=np.array([-1, -1, 0]))
    res = verify_typical_lossy(tree, rows, np.random.default_rng(0))
    assert res.accepted == [0, 2]
    rows[1] = 0.01
    rows[1, 0] = 0.91  # after node 0 the target is sure of token 0: node 2 (p = 0.01) fails; the depth-1 nodes tie
    assert verify_typical_lossy(tree, rows, np.random.default_rng(0)).accepted == [1]  # likelier: 0.5 > 0.4
    flat = np.full((4, V), 1.0 / V)  # every p(x) = 0.1 > min(0.09, 0.3/10): all pass, depth 2 wins
    assert verify_typical_lossy(tree, flat, np.random.default_rng(0)).accepted == [0, 2]
    nothing = np.zeros((4, V))
    nothing[:, 0] = 1.0  # no drafted token has mass: nothing accepted, next token from the root row
    res = verify_typical_lossy(tree, nothing, np.random.default_rng(0))
    assert res.accepted == [] and res.next_token == 0


def test_typical_acceptance_is_not_exact_and_the_exact_rule_passes_the_same_test():
    session, spec = tiny_session("chain")
    contexts = most_sensitive_prompts(session, spec)
    (exact,) = certify(session, contexts, PARAMS, draws=DRAWS, alpha=ALPHA, seed=3)
    (lossy,) = certify(session, contexts, PARAMS, draws=DRAWS, alpha=ALPHA, seed=3, verifier=lossy_verifier())
    assert exact.passed, exact  # the control: same drafter, context and draws, exact rule
    assert not lossy.passed and lossy.first_p_value < ALPHA, lossy


def test_certify_refuses_a_lossy_session(tiny_bundle, capsys):
    cfg = override(RuntimeConfig(bundle=tiny_bundle), "decoding.lossy_typical_acceptance", True)
    session = Session(override(cfg, "memory.max_context", 64))
    with pytest.raises(ConfigError, match="LOSSY"):
        certify(session, ["<|bos|>hi"], SamplingParams(temperature=1.0), draws=10)
    from tests.runtime.commands.test_cli import run_cli
    code, out, err = run_cli(["certify", "--bundle", tiny_bundle, "--backend", "numpy_ref", "--max-context", "64",
                              "--drafter", "draft_model", "--lossy-typical-acceptance"], capsys)
    assert code == 2 and "LOSSY" in err and "certify" in err and "Traceback" not in err, (code, err)
