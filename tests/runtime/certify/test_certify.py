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


def test_certify_without_the_control_says_no_control_was_run(tiny_bundle, capsys):
    from tests.runtime.commands.test_cli import run_cli
    code, out, err = run_cli(["certify", "--bundle", tiny_bundle, "--backend", "numpy_ref", "--max-context", "128",
                              "--drafter", "draft_model", "--draws", "200", "--trees", "none", "--no-control",
                              "--context", CONTEXT[0]], capsys)
    last = out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("certify: PASS"), (code, out, err)
    assert "no power control was run (--no-control)" in last and "the power control shows" not in last, last


def test_the_pass_line_claims_power_only_when_the_control_ran():
    from runtime.commands.certify import final_verdict
    assert "the power control shows" in final_verdict(["PASS"], control_run=True)[0]
    line, code = final_verdict(["PASS", "PASS"], control_run=False)
    assert code == 0 and "no power control was run" in line and "the power control shows" not in line


def test_certify_reports_every_draw_to_its_progress_callback(tiny_bundle):
    session = Session.open(tiny_bundle, drafter="draft_model", max_context=128)
    calls = []
    certify(session, CONTEXT * 2, SamplingParams(temperature=1.0), draws=5, alpha=ALPHA,
            on_draw=lambda *a: calls.append(a))
    assert calls == [(k, 2, i, 5) for k in range(2) for i in range(1, 6)]


def test_draw_progress_prints_a_line_to_stderr_once_per_interval_not_per_draw():
    import io

    from runtime.commands.certify import DrawProgress
    now = [0.0]
    out = io.StringIO()
    show = DrawProgress("chain", every_s=10, clock=lambda: now[0], out=out)
    for i in range(1, 101):  # 100 draws, 0.5 s each (a fake clock): 50 s
        now[0] += 0.5
        show(0, 6, i, 100)
    lines = out.getvalue().splitlines()
    assert lines[0] == "certify: chain: context 1/6, draw 20/100, 10 s" and len(lines) == 5, lines
