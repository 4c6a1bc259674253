"""The draft model's K-step graph (export/onnx/kstep.py, runtime/backends/onnx_kstep.py): one ONNX Runtime run drafts
the whole chain, processing the logits as runtime.sampling.process_logits and drawing by inverse CDF from the
caller's uniforms. Exactness: its draws follow the q it returns, and that q is process_logits' distribution at the
same inputs; a wrong temperature or top-p fed to it is caught. The drafter takes it for chains without a grammar
and says so in the stats; a grammar request falls back to the step-wise path, visibly. Under an adaptive shape the
chain it drafts is cut by the same per-node rule, from the same confidences, as the step-wise chain."""
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

from runtime.certify.stat_tests import chi_square_gof
from runtime.config import RuntimeConfig
from runtime.serving.session import GenerationParams, Session
from tests.support.kstep import kstep_row, loaded_weight_bytes, set_kstep

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

ALPHA = 1e-3  # significance of every chi-square test here
DRAWS = 3000  # K-step runs per chi-square test (fixed seeds)
PROMPT = "<|bos|><|text|>the robot opens the drawer and the drawer"
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)


@pytest.fixture(scope="module")
def kstep_bundle(tiny_bundle, tmp_path_factory):
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("kstep") / "bundle")
    shutil.copytree(tiny_bundle, root)
    # the K-step graph (asked for: an fp32 export writes one only with kstep "on") checked against the numpy reference
    add_onnx_to_bundle(root, "fp32", None, validate=True, kstep="on")
    _set_kstep(root, "on")  # "auto" takes it only on a GPU provider; these tests run it on the CPU one
    return root


def _set_kstep(root: str, mode: str) -> None:
    set_kstep(root, ["draft_model"], mode)


@pytest.mark.parametrize("mode, runs", [("auto", False), ("off", False), ("on", True)])
def test_the_kstep_param_chooses_the_path_auto_takes_it_only_on_a_gpu_provider(kstep_bundle, tmp_path, mode, runs):
    root = str(tmp_path / "b")
    shutil.copytree(kstep_bundle, root)
    _set_kstep(root, mode)
    spec = Session.open(root, drafter="draft_model", backend="onnx", max_context=256)
    assert (spec.drafter.kstep is not None) == runs


def test_an_unknown_kstep_mode_is_refused_naming_the_field(kstep_bundle, tmp_path):
    from runtime.errors import EdgespecError

    root = str(tmp_path / "b")
    shutil.copytree(kstep_bundle, root)
    _set_kstep(root, "fast")
    with pytest.raises(EdgespecError, match="kstep 'fast': expected one of auto, on, off"):
        Session.open(root, drafter="draft_model", backend="onnx", max_context=256)


@pytest.fixture(scope="module")
def draft(kstep_bundle):
    """(drafter, context ids) of an ONNX session on the bundle, the drafter's cache holding all but the last 2 ids."""
    session = Session.open(kstep_bundle, drafter="draft_model", backend="onnx", max_context=128)
    return session.drafter, session.tokenizer.encode(PROMPT)


def _draw_chains(drafter, context, params, n, seed):
    """n K-step runs from the same cache state: (n, K) tokens and the q rows of the first run."""
    model, ks = drafter.model, drafter.kstep
    model.reset()
    model.forward(np.asarray(context[:-2]), np.arange(len(context) - 2))
    rng = np.random.default_rng(seed)
    base = model.cache_len
    chains, first_q = [], None
    for _ in range(n):
        model.keep(base, [])
        tokens, q, _ = ks.run(context[-2:], np.arange(base, len(context)), params, context, rng.random(ks.steps))
        chains.append(tokens)
        first_q = q if first_q is None else first_q
    return np.stack(chains), first_q


def _reference_q(drafter, context, params):
    """process_logits of the draft's step-wise logits after `context`: the first drafted token's distribution."""
    from runtime.sampling import process_logits

    model = drafter.model
    model.reset()
    logits = model.forward(np.asarray(context), np.arange(len(context))).logits[-1]
    return process_logits(logits, params, context)


def test_bundle_export_records_the_kstep_graph_in_the_draft_models_onnx_entry(kstep_bundle):
    from runtime.model import bundle as bundle_mod

    entry = bundle_mod.load(kstep_bundle).drafters["draft_model"].backends["onnx"]
    assert entry.params["kstep_steps"] == 4
    assert entry.params["kstep_graph"] in entry.files


def test_kstep_draws_follow_the_q_it_returns_and_process_logits_distribution(draft):
    from runtime.sampling import SamplingParams

    drafter, context = draft
    params = SamplingParams(repetition_penalty=1.3, **SAMPLED)
    chains, q = _draw_chains(drafter, context, params, DRAWS, seed=1)
    want = _reference_q(drafter, context, params)
    np.testing.assert_allclose(q[0], want, atol=1e-5)  # the q row the graph returns is process_logits'
    counts = np.bincount(chains[:, 0], minlength=want.shape[0])
    assert chi_square_gof(counts, q[0] / q[0].sum()).p_value > ALPHA
    assert chi_square_gof(counts, want).p_value > ALPHA


def test_each_kstep_token_is_the_inverse_cdf_draw_of_the_q_it_returns_at_the_finest_mass(draft):
    """The graph draws as runtime.sampling.sample draws from the q it returns (float64 mass): a uniform aimed at the
    middle of each of the least probable tokens' CDF intervals draws that token. A float32 draw (uniform or
    cumulative mass) misses them: their mass is below float32's resolution at that point of the CDF."""
    from runtime.sampling import SamplingParams, sample

    drafter, context = draft
    params = SamplingParams(temperature=0.3)  # the random draft's logits then leave ~50 ids below float32's step
    _, q = _draw_chains(drafter, context, params, 1, seed=5)
    p = q[0].astype(np.float64)
    cdf, total = np.cumsum(p), p.sum()
    late = np.flatnonzero((cdf > 0.5 * total) & (p > 0))  # where float32's step is 2**-24 of the total
    aimed = late[np.argsort(p[late])[:12]]
    assert p[aimed[0]] / total < 2.0 ** -25  # the finest masses here are below float32's step (else no test)
    for i in aimed:
        u = (cdf[i] - 0.5 * p[i]) / total
        want = sample(p, _Fixed(u))
        assert want == i
        tokens, _ = _draw_chains_with(drafter, context, params, np.full(drafter.kstep.steps, u))
        assert tokens[0] == want


class _Fixed:
    """A generator whose every draw is u."""

    def __init__(self, u):
        self.u = u

    def random(self, *shape):
        return self.u if not shape else np.full(shape, self.u)


def _draw_chains_with(drafter, context, params, uniforms):
    """One K-step run from the cache after context[:-2] with the given uniforms -> (tokens, q)."""
    model, ks = drafter.model, drafter.kstep
    model.reset()
    model.forward(np.asarray(context[:-2]), np.arange(len(context) - 2))
    tokens, q, _ = ks.run(context[-2:], np.arange(model.cache_len, len(context)), params, context, uniforms)
    return tokens, q


@pytest.mark.parametrize("wrong", [dict(temperature=1.6), dict(top_p=0.5)])
def test_kstep_power_control_a_wrong_temperature_or_top_p_fed_to_the_graph_fails(draft, wrong):
    """The same test must reject draws made under a processing other than the request's."""
    from runtime.sampling import SamplingParams

    drafter, context = draft
    chains, _ = _draw_chains(drafter, context, SamplingParams(**{**SAMPLED, **wrong}), DRAWS, seed=2)
    want = _reference_q(drafter, context, SamplingParams(**SAMPLED))
    counts = np.bincount(chains[:, 0], minlength=want.shape[0])
    assert chi_square_gof(counts, want).p_value < ALPHA


def test_kstep_q_rows_after_the_first_are_process_logits_along_the_drafted_chain(draft):
    """Rows 1..K-1 condition on the drafted tokens: each equals process_logits after context + the chain so far."""
    from runtime.sampling import SamplingParams

    drafter, context = draft
    params = SamplingParams(**SAMPLED)
    chains, q = _draw_chains(drafter, context, params, 1, seed=3)
    for j in range(1, drafter.kstep.steps):
        np.testing.assert_allclose(q[j], _reference_q(drafter, context + chains[0, :j].tolist(), params), atol=1e-5)


@pytest.mark.parametrize("processing", [
    dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.5, top_k=100),
    dict(temperature=1.0, top_p=0.5), dict(temperature=3.0, top_p=0.999), dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.0, repetition_penalty=1.5), dict(repetition_penalty=2.0),
    dict(temperature=1.0, allowed_tokens=(3, 5, 7, 11))],
    ids=["greedy", "t1", "top_k_partial", "top_k_beyond_partial", "top_p", "top_p_beyond_partial", "min_p",
         "penalty", "greedy_penalty", "allowed"])
def test_kstep_q_equals_process_logits_for_every_processing_branch(draft, processing):
    """Every branch of the graph's processing (greedy, top-k from a partial or a full sort, top-p within the
    partial head or over the whole vocabulary, min-p, penalty, allowed tokens) gives process_logits' q."""
    from runtime.sampling import SamplingParams

    drafter, context = draft
    params = SamplingParams(**processing)
    _, q = _draw_chains(drafter, context, params, 1, seed=4)
    np.testing.assert_allclose(q[0], _reference_q(drafter, context, params), atol=1e-5)


def test_an_fp16_kstep_graph_matches_the_numpy_reference_within_fp16_tolerance(tiny_bundle, tmp_path):
    from export.onnx.graph import TOLERANCE, export_draft_model_onnx, safetensors_weights
    from export.onnx.kstep import export_kstep_onnx, validate_kstep
    from runtime.model import bundle as bundle_mod

    entry = bundle_mod.load(tiny_bundle).drafters["draft_model"]
    w = safetensors_weights(bundle_mod.load(tiny_bundle), entry.files)
    step = export_draft_model_onnx(entry.spec, w, str(tmp_path / "d.onnx"), "fp16")
    kstep = export_kstep_onnx(entry.spec, w, str(tmp_path / "k.onnx"), 3, "fp16")
    assert validate_kstep(entry.spec, w, kstep, step, 3, "fp16") <= TOLERANCE["fp16"]


def test_greedy_draft_model_through_the_kstep_path_equals_plain_decoding(kstep_bundle):
    plain = Session.open(kstep_bundle, drafter="none", backend="onnx", max_context=256)
    spec = Session.open(kstep_bundle, drafter="draft_model", backend="onnx", max_context=256)
    for prompt in (PROMPT, "<|bos|><|plan|>pick up the red cup<|sep|>"):
        a = plain.generate(prompt, GenerationParams(max_tokens=24))
        b = spec.generate(prompt, GenerationParams(max_tokens=24))
        assert a.token_ids == b.token_ids
        assert b.stats.draft_paths["kstep"] > 0 and b.stats.draft_paths["stepwise"] == 0


def test_a_grammar_request_takes_the_stepwise_path_and_the_stats_say_so(kstep_bundle):
    spec = Session.open(kstep_bundle, drafter="draft_model", backend="onnx", max_context=256)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    res = spec.generate("<|bos|><|plan|>answer<|sep|>", GenerationParams(max_tokens=12), json_schema=schema)
    assert res.stats.draft_paths["kstep"] == 0 and res.stats.draft_paths["stepwise"] > 0
    free = spec.generate(PROMPT, GenerationParams(max_tokens=12))  # the same session without a grammar: K-step again
    assert free.stats.draft_paths["kstep"] > 0


def test_kstep_on_a_device_arena_writes_the_same_rows_and_drafts_the_same_chain_as_on_the_host_arena(draft, kstep_bundle):
    """The OrtValue arena a GPU uses (here on the CPU provider): K/V bound by device address, rows written in place."""
    from runtime.backends.numpy_ref import cache_shape
    from runtime.backends.onnx import OnnxTarget
    from runtime.backends.onnx_kstep import OnnxKStep
    from runtime.memory.kv import KVArena
    from runtime.sampling import SamplingParams

    drafter, context = draft
    host = drafter.model
    shape, n = cache_shape(host.spec), 64
    dev = OnnxTarget(host.spec, host.model_path, KVArena.for_context({"d": shape}, n).allocate("d", shape, n),
                     tap_names=(), arena_device="cpu")
    ks = OnnxKStep(dev, drafter.kstep.model_path, drafter.kstep.steps)
    params, u = SamplingParams(temperature=1.0), np.random.default_rng(5).random(ks.steps)
    got = []
    for model, kstep in ((host, drafter.kstep), (dev, ks)):
        model.reset()
        model.forward(np.asarray(context[:-2]), np.arange(len(context) - 2))
        got.append(kstep.run(context[-2:], np.arange(len(context) - 2, len(context)), params, context, u))
        assert model.cache_len == len(context) + ks.steps - 1
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_allclose(got[0][1], got[1][1], atol=1e-6)
    for layer in range(host.spec.num_layers):
        np.testing.assert_allclose(host.layer_kv(layer)[0], dev.layer_kv(layer)[0], atol=1e-6)


def test_an_export_writes_the_kstep_graph_for_fp16_by_default_and_for_any_float_precision_when_asked():
    import doctest

    import export.onnx.bundle as onnx_bundle
    from export.onnx.bundle import kstep_wanted

    assert [kstep_wanted("auto", p) for p in ("fp32", "fp16")] == [False, True]  # where runtime "auto" runs it
    assert kstep_wanted("on", "fp32") and not kstep_wanted("off", "fp16")
    assert doctest.testmod(onnx_bundle).failed == 0


def _restamp(root: str, rel: str) -> None:
    """The manifest's checksum and size of `rel`, after a test rewrote that file."""
    import yaml

    from runtime.model.bundle import sha256_of

    path = os.path.join(root, "bundle.yaml")
    with open(path) as f:
        m = yaml.safe_load(f)
    m["files"][rel] = {"sha256": sha256_of(os.path.join(root, rel)), "size": os.path.getsize(os.path.join(root, rel))}
    with open(path, "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)


# A template's reach by depth (NodeRule.reach): it floors a SAMPLED node's gain, here above the 0.3-token margin at
# depths 1 and 2 only, so a sampled chain whose path confidence has fallen below 0.5 still earns those two nodes
# (the step-wise level check once ignored the floor and stopped after one).
REACH = (0.4, 0.4, 0.0, 0.0)


def _adaptive_pair(kstep_bundle, tmp_path, reach=()):
    """Two adaptive sessions on the bundle, the K-step path on and off, and the path's per-node rule made to bite: a
    calibration that believes nodes below path confidence 0.5 are never accepted, valued at a rate where a node must
    earn 0.3 tokens (the step-wise chain then stops at the first unsure node), with the template's `reach`."""
    from runtime.speculation import Calibration, CostModel, NodeRule

    sessions = []
    for mode in ("on", "off"):
        root = str(tmp_path / mode)
        shutil.copytree(kstep_bundle, root)
        _set_kstep(root, mode)
        sessions.append(Session.open(root, drafter="draft_model", backend="onnx", max_context=256, shape="adaptive"))
    cal = Calibration(prior_weight=0.0)
    cal.observe([0.05, 0.25, 0.45, 0.55, 0.75, 0.97], [False, False, False, True, True, True])
    rule = NodeRule(CostModel(((1, 1.0), (2, 1.2))), cal, rate=1.5, reach=reach)  # margin 1.5 x 0.2 = 0.3 tokens
    return sessions, rule


@pytest.mark.parametrize("params,reach", [(dict(), ()), (dict(temperature=1.0), ()), (dict(temperature=1.0), REACH)],
                         ids=["greedy", "sampled", "sampled_reach"])
def test_an_adaptive_chain_through_the_kstep_graph_is_cut_where_the_stepwise_chain_is(kstep_bundle, tmp_path, params,
                                                                                       reach):
    """The per-node rule cuts the graph's chain after the run exactly where the step-wise path stops drafting, and the
    tree carries the same path confidences: greedy the same tokens; sampled the same cut for the same draws, also
    where the template's reach keeps nodes the calibration alone would not (the step-wise level check counts it)."""
    from runtime.drafters.base import DraftContext
    from runtime.sampling import SamplingParams

    (on, off), rule = _adaptive_pair(kstep_bundle, tmp_path, reach)
    context = on.tokenizer.encode(PROMPT)
    sp = SamplingParams(**params)
    cuts, unfloored = [], []
    for seed in range(6):
        trees = []
        for s, r in ((on, rule), (off, rule), (off, replace(rule, reach=()))):
            s.drafter.reset()
            ctx = DraftContext(context, sp, np.random.default_rng(seed), 4, None, r, True)
            trees.append(s.drafter.propose(ctx))
            s.drafter.accept([], [context[-1]], {})
        a, b, c = trees
        unfloored.append(len(c))
        assert on.drafter.draft_paths["kstep"] == seed + 1 and off.drafter.draft_paths["kstep"] == 0
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-4)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        if not sp.greedy and len(a):
            np.testing.assert_allclose(a.q, b.q, atol=1e-5)
        cuts.append(len(a))
    assert min(cuts) < 4, "the rule never cut the chain: the comparison says nothing about the cut"
    if reach:
        assert cuts != unfloored, "the reach kept no node the calibration alone cut: the case says nothing of it"


def test_an_adaptive_session_on_the_kstep_path_records_its_calibration_and_stops_unpaying_drafts(kstep_bundle, tmp_path):
    """The tiny bundle's random draft model is never accepted: the adaptive rule must learn that from the confidences
    the K-step graph returns (before them it drafted ~3.7 nodes a cycle there, against ~0.2 step-wise)."""
    (on, off), _ = _adaptive_pair(kstep_bundle, tmp_path)
    got = {}
    for name, s in (("on", on), ("off", off)):
        r = s.generate(PROMPT, GenerationParams(max_tokens=40))
        got[name] = r.stats
    assert got["on"].draft_paths["kstep"] > 0 and got["on"].calibration
    assert got["on"].mean_nodes <= got["off"].mean_nodes + 0.5
    assert got["on"].mean_nodes < 1.0


def test_a_kstep_graph_without_confidences_serves_fixed_chains_and_leaves_adaptive_ones_to_the_stepwise_path(
        kstep_bundle, tmp_path):
    """An export from before the confidence output: a fixed chain still takes it; an adaptive one, which needs the
    confidences, takes the step-wise path and the stats say so."""
    import onnx

    root = str(tmp_path / "old")
    shutil.copytree(kstep_bundle, root)
    _set_kstep(root, "on")
    path = next(os.path.join(root, "onnx", f) for f in os.listdir(os.path.join(root, "onnx")) if ".kstep" in f
                and f.endswith(".onnx"))
    model = onnx.load(path, load_external_data=False)
    keep = [o for o in model.graph.output if o.name != "confidence"]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    onnx.save(model, path)
    _restamp(root, os.path.relpath(path, root))
    fixed = Session.open(root, drafter="draft_model", backend="onnx", max_context=256, shape="fixed")
    adaptive = Session.open(root, drafter="draft_model", backend="onnx", max_context=256, shape="adaptive")
    assert not fixed.drafter.kstep.has_confidence
    r = fixed.generate(PROMPT, GenerationParams(max_tokens=16))
    assert r.stats.draft_paths["kstep"] > 0 and r.stats.draft_paths["stepwise"] == 0
    r = adaptive.generate(PROMPT, GenerationParams(max_tokens=16))
    assert r.stats.draft_paths["kstep"] == 0 and r.stats.draft_paths["stepwise"] > 0


def test_the_memory_plan_counts_a_kstep_graph_where_it_runs_as_a_second_session_of_its_weights(kstep_bundle, tmp_path):
    """ONNX Runtime holds a K-step graph's weights in its own session (the zoo draft model's added 20 MiB of
    resident memory): a session that runs it plans every weight the graph references (also those stored in the
    step graph's data file) as a row of its own; one that does not (kstep off, or auto on a CPU provider) plans
    none; the memory CLI, planning a robot's GPU, counts auto."""
    from runtime.drafters import registry
    from runtime.model import bundle as bundle_mod

    b = bundle_mod.load(kstep_bundle)
    want = loaded_weight_bytes(b.path(b.drafters["draft_model"].backends["onnx"].params["kstep_graph"]))
    on = Session.open(kstep_bundle, drafter="draft_model", backend="onnx", max_context=128)  # the fixture's kstep on
    assert on.drafter.kstep is not None and kstep_row(on.plan_inputs) == want > 0
    for mode, providers, counted in (("off", None, False), ("auto", ("CPUExecutionProvider",), False),
                                     ("auto", None, True)):
        root = str(tmp_path / f"{mode}-{providers is None}")
        shutil.copytree(kstep_bundle, root)
        _set_kstep(root, mode)
        inp = registry.plan_inputs(bundle_mod.load(root), "draft_model", "onnx", 5, providers=providers)
        assert kstep_row(inp) == (want if counted else 0), (mode, providers)
    assert kstep_row(registry.plan_inputs(b, "none", "onnx", 5)) == 0


def test_split_chains_never_open_the_kstep_graph_nor_plan_its_session(kstep_bundle):
    """The graph drafts one chain; a session drafting branching > 1 chains drafts them step-wise, so it neither opens
    the K-step session (~20 MiB resident for the zoo draft model) nor counts it in the plan."""
    from runtime.drafters import registry
    from runtime.model import bundle as bundle_mod

    cfg = RuntimeConfig(bundle=kstep_bundle)
    cfg = replace(cfg, drafter=replace(cfg.drafter, kind="draft_model", branching=2),
                  backend=replace(cfg.backend, kind="onnx"), memory=replace(cfg.memory, max_context=128))
    split = Session(cfg)
    assert split.drafter.kstep is None and kstep_row(split.plan_inputs) == 0
    out = split.generate("hello there", GenerationParams(max_tokens=6))
    assert out.stats.draft_paths.get("kstep", 0) == 0
    split.close()
    b = bundle_mod.load(kstep_bundle)
    assert kstep_row(registry.plan_inputs(b, "draft_model", "onnx", 9, branching=2)) == 0
    assert kstep_row(registry.plan_inputs(b, "draft_model", "onnx", 5, branching=1)) > 0
