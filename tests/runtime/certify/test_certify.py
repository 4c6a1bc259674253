"""`certify` on a real bundle and backend: speculative sampling passes the chi-square test against the
exact target distribution, and a deliberately wrong acceptance rule fails it (the test has power).

alpha = 0.001; DRAWS draws per context; fixed seeds."""
import pytest

from runtime.certify.run import certify
from runtime.sampling import SamplingParams, sample
from runtime.serving.session import Session
from runtime.verify import VerifyResult

ALPHA = 1e-3
DRAWS = 3000
CONTEXT = ["<|bos|><|plan|>pick up the red cup<|sep|>"]


def always_accept(tree, p, rng):
    """A WRONG rule: accept the first child at every depth, whatever the target says."""
    node, accepted = -1, []
    while tree.children(node):
        node = tree.children(node)[0]
        accepted.append(node)
    return VerifyResult(accepted, sample(p[node + 1], rng))


@pytest.mark.parametrize("drafter,params", [
    ("draft_model", SamplingParams(temperature=1.0)),
    ("draft_model", SamplingParams(temperature=0.7, top_p=0.9)),
    ("ngram", SamplingParams(temperature=1.0)),
])
def test_speculative_sampling_passes_certify_on_a_real_bundle(tiny_bundle, drafter, params):
    session = Session.open(tiny_bundle, drafter=drafter, max_context=128)
    (res,) = certify(session, CONTEXT, params, draws=DRAWS, alpha=ALPHA, seed=5)
    assert res.passed, res


def test_certify_rejects_a_wrong_acceptance_rule(tiny_bundle):
    session = Session.open(tiny_bundle, drafter="draft_model", max_context=128)
    (res,) = certify(session, CONTEXT, SamplingParams(temperature=1.0), draws=1500, alpha=ALPHA, verifier=always_accept)
    assert not res.passed and res.first_p_value < ALPHA


# --- the command refuses what would make the test meaningless (one line, exit 2, no traceback) -----------

@pytest.mark.parametrize("flags,message", [
    (["--temperature", "0"], "--temperature: got 0.0, expected a finite number > 0"),
    (["--alpha", "2"], "--alpha: got 2.0, expected a significance level in (0, 0.5)"),
    (["--alpha", "0"], "--alpha: got 0.0"),
    (["--draws", "0"], "--draws: got 0, expected an integer >= 1"),
    (["--trees", "two"], "--trees: got 'two'"),
    (["--drafter", "none"], "--drafter: certify needs a drafter"),
])
def test_certify_refuses_meaningless_settings_naming_the_flag(tiny_bundle, capsys, flags, message):
    from tests.runtime.commands.test_cli import run_cli
    code, out, err = run_cli(["certify", "--bundle", tiny_bundle, "--backend", "numpy_ref", "--max-context", "128",
                              *flags], capsys)
    assert code == 2 and message in err and "Traceback" not in err, (code, err)


def test_certify_with_few_draws_warns_that_the_test_has_no_power(tiny_bundle, capsys):
    from tests.runtime.commands.test_cli import run_cli
    code, out, err = run_cli(["certify", "--bundle", tiny_bundle, "--backend", "numpy_ref", "--max-context", "128",
                              "--drafter", "draft_model", "--draws", "10", "--trees", "none", "--no-control",
                              "--context", CONTEXT[0]], capsys)
    assert "almost no power" in err and code in (0, 1), (code, err)


def test_certify_tests_a_fixed_shape_drafter_once_in_its_own_shape():
    # Medusa's tree is its choice list: setting `branching` would change nothing, so "branching 2, 3" runs
    # would re-test one shape under wrong labels (and a chain's dedup control could never fail)
    from types import SimpleNamespace

    from runtime.commands.certify import tree_widths
    from runtime.errors import ConfigError
    medusa_like = SimpleNamespace(kind="medusa", fixed_shape=True, builds_sampled_trees=True, branching=3)
    assert tree_widths("auto", 1, medusa_like) == [3]
    assert tree_widths("auto", 1, SimpleNamespace(kind="medusa", fixed_shape=True, branching=1)) == [1]
    with pytest.raises(ConfigError, match="--trees"):
        tree_widths("2,3", 1, medusa_like)
    draft_like = SimpleNamespace(kind="draft_model", fixed_shape=False, builds_sampled_trees=True, takes_branching=True,
                                 branching=1)
    assert tree_widths("auto", 1, draft_like) == [1, 2, 3]
