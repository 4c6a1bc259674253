"""A single MTP module's chain in one run: its K-step graph (export/drafters/mtp_onnx.py on head_kstep.py,
runtime/drafters/heads.HeadKStep) runs the module over the rows its cache lacks, then K draft steps on its own
output. Exactness: on the same uniforms it drafts the step-wise chain's tokens with the step-wise q rows and
confidences under every processing branch; its first draws follow the q it returns and the step-wise path's
distribution (chi-square, alpha 0.001), and a wrong temperature fed to it is caught (power control); greedy sessions
through it equal plain decoding; the fp16 export (the GPU one) writes it too. A tiny random target with one
DeepSeek-V3-style module (tests/support/mtp_tiny.py)."""
import os

import numpy as np
import pytest

from runtime.certify.stat_tests import chi_square_gof
from runtime.drafters.base import DraftContext
from runtime.sampling import SamplingParams
from runtime.serving.session import GenerationParams, Session
from export.drafters.head_kstep import Replay
from tests.support.kstep import set_kstep
from tests.support.mtp_tiny import write_mtp_checkpoint

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

ALPHA = 1e-3
DRAWS = 3000
PROMPT = "<|bos|><|text|>the robot opens the drawer and the drawer"
PROCESSING = {"temperature": dict(temperature=0.8), "top_k": dict(temperature=1.0, top_k=5),
              "top_p": dict(temperature=1.0, top_p=0.7), "penalty": dict(temperature=1.0, repetition_penalty=1.3),
              "greedy": dict()}


def _build(root: str, precision: str) -> str:
    from export.bundle.builder import build_bundle
    from export.onnx.bundle import add_onnx_to_bundle

    out = build_bundle(write_mtp_checkpoint(root, modules=1), os.path.join(root, "bundle"), name="mtp1")
    add_onnx_to_bundle(out, precision, kstep="on")
    set_kstep(out, ["mtp"], "on")  # "auto" takes it only on a GPU provider; these tests run it on the CPU one
    return out


@pytest.fixture(scope="module")
def mtp_bundle(tmp_path_factory):
    return _build(str(tmp_path_factory.mktemp("mtp_kstep")), "fp32")


@pytest.fixture(scope="module")
def module(mtp_bundle):
    """(drafter, context ids, target hiddens of the context's rows) of an ONNX session with the K-step graph."""
    s = Session.open(mtp_bundle, drafter="mtp", backend="onnx", max_context=128)
    context = s.tokenizer.encode(PROMPT)
    hidden = np.random.default_rng(7).normal(0, 1, (len(context) - 1, s.drafter.spec.hidden_size)).astype(np.float32)
    assert s.drafter.kstep is not None
    return s.drafter, context, hidden


def _propose(drafter, context, hidden, params, u, kstep: bool):
    saved = drafter.kstep
    if not kstep:
        drafter.kstep = None
    try:
        drafter.reset()
        drafter.pending[0] = list(hidden)
        return drafter.propose(DraftContext(context, params, Replay(u), drafter.k, None, None, True))
    finally:
        drafter.kstep = saved
        drafter.reset()


def test_export_records_the_kstep_graph_in_the_mtp_entry(mtp_bundle):
    from runtime.model import bundle as bundle_io

    files = bundle_io.load(mtp_bundle).drafters["mtp"].backends["onnx"]
    assert files.params["kstep_graph"] == "onnx/drafter.mtp.kstep4.fp32.onnx" and files.params["kstep_steps"] == 4
    assert files.params["kstep_graph"] in files.files


@pytest.mark.parametrize("processing", sorted(PROCESSING))
def test_on_the_same_uniforms_the_graph_drafts_the_stepwise_chain_with_its_q_and_confidences(module, processing):
    drafter, context, hidden = module
    params = SamplingParams(**PROCESSING[processing])
    for seed in range(3):
        u = np.random.default_rng(seed).random(drafter.kstep.steps)
        before = drafter.draft_paths["kstep"]
        a = _propose(drafter, context, hidden, params, u, kstep=True)
        assert drafter.draft_paths["kstep"] == before + 1
        b = _propose(drafter, context, hidden, params, u, kstep=False)
        assert len(a) == len(b) == drafter.k
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-4, atol=1e-6)
        if not params.greedy:
            np.testing.assert_allclose(a.q, b.q, atol=1e-5)


def _first_draws(drafter, context, hidden, params, n, seed):
    rng = np.random.default_rng(seed)
    first, q0 = [], None
    cache = drafter.modules[0].cache
    for _ in range(n):
        cache.reset()
        got = drafter.kstep.run(cache, context[1:], hidden, np.arange(len(context) - 1), params, context,
                                rng.random(drafter.kstep.steps))
        first.append(int(got.tokens[0]))
        q0 = got.q[0] if q0 is None else q0
    drafter.reset()
    return np.bincount(first, minlength=len(q0)), q0.astype(np.float64)


def test_the_graphs_first_draws_follow_its_q_and_the_stepwise_distribution(module):
    drafter, context, hidden = module
    params = SamplingParams(temperature=0.8, top_k=20)
    counts, q = _first_draws(drafter, context, hidden, params, DRAWS, seed=11)
    want = _propose(drafter, context, hidden, params, [0.5] * drafter.k, kstep=False).q[0]
    np.testing.assert_allclose(q / q.sum(), want, atol=1e-5)
    assert chi_square_gof(counts, q / q.sum()).p_value > ALPHA
    assert chi_square_gof(counts, want).p_value > ALPHA


def test_power_control_draws_made_at_a_wrong_temperature_are_caught(module):
    drafter, context, hidden = module
    counts, _ = _first_draws(drafter, context, hidden, SamplingParams(temperature=1.6, top_k=20), DRAWS, seed=11)
    want = _propose(drafter, context, hidden, SamplingParams(temperature=0.8, top_k=20), [0.5] * drafter.k,
                    kstep=False).q[0]
    assert chi_square_gof(counts, want).p_value < ALPHA


def test_greedy_mtp_through_the_kstep_path_equals_plain_decoding(mtp_bundle):
    plain = Session.open(mtp_bundle, drafter="none", backend="onnx", max_context=256)
    spec = Session.open(mtp_bundle, drafter="mtp", backend="onnx", max_context=256)
    for prompt in (PROMPT, "<|bos|><|plan|>pick up the red cup<|sep|>"):
        a = plain.generate(prompt, GenerationParams(max_tokens=24))
        b = spec.generate(prompt, GenerationParams(max_tokens=24))
        assert a.token_ids == b.token_ids
        assert b.stats.draft_paths["kstep"] > 0


def test_the_fp16_export_writes_the_kstep_graph_checked_in_float32(tmp_path):
    """The GPU export: the module and its K-step graph in fp16; the chain logic checked on the graph's float32 build
    (fp16 near-ties would draw other tokens than the float32 reference), which is not left in the bundle; a greedy
    session on the fp16 graphs through it equals plain decoding on the same graphs."""
    from runtime.model import bundle as bundle_io

    root = _build(str(tmp_path), "fp16")
    b = bundle_io.load(root)
    files = b.drafters["mtp"].backends["onnx"]
    assert files.params["kstep_graph"] == "onnx/drafter.mtp.kstep4.fp16.onnx"
    assert not [f for f in os.listdir(os.path.join(root, "onnx")) if "check32" in f]
    plain = Session.open(root, drafter="none", backend="onnx", max_context=256)
    spec = Session.open(root, drafter="mtp", backend="onnx", max_context=256)
    a, b = (s.generate(PROMPT, GenerationParams(max_tokens=24)) for s in (plain, spec))
    assert a.token_ids == b.token_ids and b.stats.draft_paths["kstep"] > 0
