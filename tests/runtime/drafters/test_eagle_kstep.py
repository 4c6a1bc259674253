"""EAGLE chains in one run: the head's K-step graph (export/drafters/eagle_kstep.py, runtime/drafters/heads.HeadKStep)
runs the rows the head's cache lacks, K draft steps on the layer's own output, the logits processing and the draws
from the caller's uniforms. Exactness: on the same uniforms it drafts the step-wise chain's tokens with the
step-wise q rows and confidences under every processing branch (EAGLE-1, and EAGLE-3 with a reduced vocabulary);
its first draws follow the q it returns and the step-wise path's distribution (chi-square, alpha 0.001), and a
wrong temperature fed to it is caught (power control); greedy sessions through it equal plain decoding; an
adaptive shape cuts its chain where the step-wise chain is cut. Random official-layout heads on the tiny bundle."""
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

from runtime.certify.stat_tests import chi_square_gof
from runtime.drafters.base import DraftContext
from runtime.sampling import SamplingParams
from runtime.serving.session import GenerationParams, Session
from export.drafters.head_kstep import Replay
from tests.support.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint
from tests.support.kstep import kstep_row, loaded_weight_bytes, set_kstep

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

ALPHA = 1e-3
DRAWS = 3000
PROMPT = "navigate to the kitchen and"
CHAINS = ("eagle", "eagle3_chain")  # EAGLE-1 over the target's head; EAGLE-3 over a 100-token draft vocabulary
PROCESSING = {"temperature": dict(temperature=0.8), "top_k": dict(temperature=1.0, top_k=5),
              "top_p": dict(temperature=1.0, top_p=0.7), "min_p": dict(temperature=1.2, min_p=0.05),
              "penalty": dict(temperature=1.0, repetition_penalty=1.3), "greedy": dict()}


@pytest.fixture(scope="module")
def kstep_bundle(tiny_bundle, tmp_path_factory):
    from export.drafters.eagle import add_eagle_to_bundle
    from export.onnx.bundle import add_onnx_to_bundle
    from runtime.model import bundle as bundle_io

    d = tmp_path_factory.mktemp("eagle_kstep")
    root = str(d / "bundle")
    shutil.copytree(tiny_bundle, root)
    spec = bundle_io.load(root).target.spec
    add_eagle_to_bundle(root, eagle1_checkpoint(str(d / "e1"), spec, seed=1), name="eagle")
    e3 = eagle3_checkpoint(str(d / "e3"), spec, seed=2, draft_vocab=100)
    # as in the zoo: one head serves a dynamic tree (listed first) and a chain, so its K-step graph is exported
    # from the tree user's drafter and must still be checked against the step-wise CHAIN
    add_eagle_to_bundle(root, e3, name="eagle3", tree={"total_tokens": 10, "depth": 4, "top_k": 3})
    add_eagle_to_bundle(root, e3, name="eagle3_chain")
    add_onnx_to_bundle(root, "fp32", None, validate=True, kstep="on")  # the K-step graphs checked against numpy
    _set_kstep(root, "on")  # "auto" takes them only on a GPU provider; these tests run them on the CPU one
    return root


def _set_kstep(root: str, mode: str) -> None:
    set_kstep(root, CHAINS, mode)


@pytest.fixture(scope="module")
def heads(kstep_bundle):
    """{name: (drafter, context ids, features of the context's rows)}: ONNX sessions' drafters with their graphs."""
    out = {}
    for name in CHAINS:
        s = Session.open(kstep_bundle, drafter=name, backend="onnx", max_context=128)
        context = s.tokenizer.encode(PROMPT)
        feats = np.random.default_rng(7).standard_normal((len(context) - 1, s.drafter.spec.hidden_size))
        out[name] = (s.drafter, context, (0.5 * feats).astype(np.float32))
    return out


def _stepwise(drafter, context, feats, params, u, stop=None):
    """The step-wise chain (the head's step graph, numpy processing) from a fresh cache on the uniforms u."""
    ks, drafter.kstep = drafter.kstep, None
    try:
        drafter.reset()
        drafter.pending = feats
        return drafter.propose(DraftContext(context, params, Replay(u), drafter.k, None, stop, True))
    finally:
        drafter.kstep = ks
        drafter.reset()


def _kstep(drafter, context, feats, params, u, stop=None):
    """The same chain through the K-step graph, by the drafter's own K-step path."""
    drafter.reset()
    drafter.pending = feats
    before = drafter.draft_paths["kstep"]
    tree = drafter.propose(DraftContext(context, params, Replay(u), drafter.k, None, stop, True))
    assert drafter.draft_paths["kstep"] == before + 1
    drafter.reset()
    return tree


def test_export_records_a_kstep_graph_in_each_eagle_chains_onnx_entry(kstep_bundle):
    """One graph per head, in the entries of every drafter the head serves; a dynamic tree never runs it."""
    from runtime.model import bundle as bundle_io

    b = bundle_io.load(kstep_bundle)
    for name, head in (("eagle", "eagle"), ("eagle3_chain", "eagle3"), ("eagle3", "eagle3")):
        files = b.drafters[name].backends["onnx"]
        rel = files.params["kstep_graph"]
        assert rel == f"onnx/drafter.{head}.kstep4.fp32.onnx" and files.params["kstep_steps"] == 4
        assert rel in files.files and os.path.isfile(b.path(rel))
    tree = Session.open(kstep_bundle, drafter="eagle3", backend="onnx", max_context=128)
    assert tree.drafter.kstep is None and tree.drafter.draft_paths == {}


@pytest.mark.parametrize("name", CHAINS)
@pytest.mark.parametrize("processing", sorted(PROCESSING))
def test_on_the_same_uniforms_the_graph_drafts_the_stepwise_chain_with_its_q_and_confidences(heads, name, processing):
    drafter, context, feats = heads[name]
    params = SamplingParams(**PROCESSING[processing])
    for seed in range(3):
        u = np.random.default_rng(seed).random(drafter.kstep.steps)
        a, b = _kstep(drafter, context, feats, params, u), _stepwise(drafter, context, feats, params, u)
        assert len(a) == len(b) == drafter.k
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-4, atol=1e-6)
        if not params.greedy:
            np.testing.assert_allclose(a.q, b.q, atol=1e-5)


def _first_draws(drafter, context, feats, params, n, seed):
    """n K-step runs from the same cache state (fresh uniforms each): their first tokens, and the graph's q row."""
    rng = np.random.default_rng(seed)
    first, q0 = [], None
    for _ in range(n):
        drafter.reset()
        got = drafter.kstep.run(drafter.cache, context[1:], feats, np.arange(len(context) - 1), params, context,
                                rng.random(drafter.kstep.steps))
        first.append(int(got.tokens[0]))
        q0 = got.q[0] if q0 is None else q0
    drafter.reset()
    return np.bincount(first, minlength=len(q0)), q0.astype(np.float64)


@pytest.mark.parametrize("name", CHAINS)
def test_the_graphs_first_draws_follow_its_q_and_the_stepwise_distribution(heads, name):
    drafter, context, feats = heads[name]
    params = SamplingParams(temperature=0.8, top_k=20)
    counts, q = _first_draws(drafter, context, feats, params, DRAWS, seed=11)
    want = _stepwise(drafter, context, feats, params, [0.5] * drafter.k).q[0]
    np.testing.assert_allclose(q / q.sum(), want, atol=1e-5)
    assert chi_square_gof(counts, q / q.sum()).p_value > ALPHA
    assert chi_square_gof(counts, want).p_value > ALPHA


@pytest.mark.parametrize("name", CHAINS)
def test_power_control_draws_made_at_a_wrong_temperature_are_caught(heads, name):
    """The graph fed temperature 1.6 where the request says 0.8: its draws against the request's distribution."""
    drafter, context, feats = heads[name]
    params = SamplingParams(temperature=0.8, top_k=20)
    counts, _ = _first_draws(drafter, context, feats, SamplingParams(temperature=1.6, top_k=20), DRAWS, seed=11)
    want = _stepwise(drafter, context, feats, params, [0.5] * drafter.k).q[0]
    assert chi_square_gof(counts, want).p_value < ALPHA


@pytest.mark.parametrize("name", CHAINS)
def test_greedy_eagle_chains_through_the_kstep_path_equal_plain_decoding(kstep_bundle, name):
    plain = Session.open(kstep_bundle, drafter="none", backend="onnx", max_context=256)
    spec = Session.open(kstep_bundle, drafter=name, backend="onnx", max_context=256)
    for prompt in (PROMPT, "pick up the red cup and put it"):
        a = plain.generate(prompt, GenerationParams(max_tokens=24))
        b = spec.generate(prompt, GenerationParams(max_tokens=24))
        assert a.token_ids == b.token_ids
        assert b.stats.draft_paths["kstep"] > 0 and b.stats.draft_paths["stepwise"] == 0


@pytest.mark.parametrize("processing,reach", [("greedy", ()), ("temperature", ()), ("temperature", (0.4, 0.4, 0.0))],
                         ids=["greedy", "temperature", "temperature_reach"])
def test_an_adaptive_eagle_chain_through_the_graph_is_cut_where_the_stepwise_chain_is(heads, processing, reach):
    """As the draft model's: the same cut and confidences, also where the template's reach (depths 1-2 floored above
    the margin) keeps sampled nodes the calibration alone would not."""
    from runtime.speculation import Calibration, CostModel, NodeRule

    drafter, context, feats = heads["eagle3_chain"]
    cal = Calibration(prior_weight=0.0)
    cal.observe([0.005, 0.02, 0.05, 0.15, 0.25, 0.45, 0.97], [False, False, False, True, True, True, True])
    rule = NodeRule(CostModel(((1, 1.0), (2, 1.2))), cal, rate=1.5, reach=reach)  # a node must earn 0.3 tokens
    params = SamplingParams(**PROCESSING[processing])
    cuts, unfloored = [], []
    for seed in range(8):
        u = np.random.default_rng(seed).random(drafter.kstep.steps)
        a = _kstep(drafter, context, feats, params, u, rule)
        b = _stepwise(drafter, context, feats, params, u, rule)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-4, atol=1e-6)
        cuts.append(len(a))
        unfloored.append(len(_kstep(drafter, context, feats, params, u, replace(rule, reach=()))))
    assert min(cuts) < drafter.k, "the rule never cut the chain: the comparison says nothing about the cut"
    if reach:
        assert cuts != unfloored, "the reach kept no node the calibration alone cut: the case says nothing of it"


def test_a_grammar_request_and_a_tree_take_the_stepwise_path(kstep_bundle):
    s = Session.open(kstep_bundle, drafter="eagle", backend="onnx", max_context=256)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = s.generate(PROMPT, GenerationParams(max_tokens=12), json_schema=schema)
    assert r.stats.draft_paths["kstep"] == 0 and r.stats.draft_paths["stepwise"] > 0


def test_the_memory_plan_counts_a_chain_heads_kstep_graph_with_the_target_weights_it_shares_and_none_for_a_tree(
        kstep_bundle):
    """A chain's K-step graph is planned at every weight it references, the target's embedding / head stored in
    the target's data file among them; a dynamic tree never opens one, so its entry plans none."""
    from runtime.drafters import registry
    from runtime.model import bundle as bundle_io

    b = bundle_io.load(kstep_bundle)
    for name in CHAINS:
        rel = b.drafters[name].backends["onnx"].params["kstep_graph"]
        want = loaded_weight_bytes(b.path(rel))
        assert _data_files(b.path(rel)) - {os.path.basename(rel) + ".data"}  # weights of other graphs' files too
        s = Session.open(kstep_bundle, drafter=name, backend="onnx", max_context=128)
        assert s.drafter.kstep is not None and kstep_row(s.plan_inputs) == want > 0, name
    assert kstep_row(registry.plan_inputs(b, "eagle3", "onnx", 5, providers=None)) == 0
    # split chains (branching > 1) draft step-wise: no K-step session opened, none planned
    from runtime.config import RuntimeConfig

    cfg = RuntimeConfig(bundle=kstep_bundle)
    for name in CHAINS:
        split = Session(replace(cfg, drafter=replace(cfg.drafter, kind=name, branching=2),
                                backend=replace(cfg.backend, kind="onnx"), memory=replace(cfg.memory, max_context=128)))
        assert split.drafter.kstep is None and kstep_row(split.plan_inputs) == 0, name
        split.close()
        assert kstep_row(registry.plan_inputs(b, name, "onnx", 9, providers=None, branching=2)) == 0, name


def _data_files(graph_path: str) -> set:
    """The data files an ONNX graph's external weights lie in."""
    import onnx

    model = onnx.load(graph_path, load_external_data=False)
    return {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
