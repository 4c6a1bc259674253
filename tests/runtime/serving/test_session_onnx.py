"""A bundle exported for ONNX Runtime serves the same requests as on the numpy reference: the target and
the draft model run as ONNX graphs on one KV arena, and greedy speculative output equals plain decoding."""
import os
import shutil

import pytest

from runtime.serving.session import GenerationParams, Session

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")


@pytest.fixture(scope="module")
def onnx_bundle(tiny_bundle, tmp_path_factory):
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("onnx") / "bundle")
    shutil.copytree(tiny_bundle, root)
    add_onnx_to_bundle(root, "fp32", None, validate=False)
    return root


PROMPTS = ["<|bos|><|plan|>pick up the red cup<|sep|>", "<|bos|><|text|>the robot opens the drawer and the drawer"]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "none"])
def test_onnx_session_greedy_output_equals_the_numpy_reference(onnx_bundle, drafter):
    ref = Session.open(onnx_bundle, drafter="none", backend="numpy_ref", max_context=256)
    onnx = Session.open(onnx_bundle, drafter=drafter, backend="onnx", max_context=256)
    assert onnx.target.name == "onnx"
    if drafter == "draft_model":
        assert onnx.drafter.model.name == "onnx"  # the draft model runs as its own graph too
    for prompt in PROMPTS:
        a = ref.generate(prompt, GenerationParams(max_tokens=20))
        b = onnx.generate(prompt, GenerationParams(max_tokens=20))
        assert a.token_ids == b.token_ids
        assert b.stats.backend == "onnx"


def test_sampled_speculative_decoding_on_onnx_passes_certify(onnx_bundle):
    """alpha = 0.001, 2000 draws, fixed seed: the exactness test of the verification issue on this backend."""
    from runtime.certify.run import certify
    from runtime.sampling import SamplingParams

    session = Session.open(onnx_bundle, drafter="draft_model", backend="onnx", max_context=128)
    (res,) = certify(session, PROMPTS[:1], SamplingParams(temperature=1.0), draws=2000, alpha=1e-3, seed=9)
    assert res.passed, res


def test_the_default_backend_is_onnx_where_onnxruntime_is_installed_and_the_bundle_has_graphs(onnx_bundle):
    """numpy_ref is the slow oracle: a plain request runs on ONNX Runtime unless the oracle is asked for."""
    assert Session.open(onnx_bundle, drafter="none", max_context=64).backend_name == "onnx"
    assert Session.open(onnx_bundle, drafter="none", backend="numpy_ref", max_context=64).backend_name == "numpy_ref"


def test_sessions_of_one_bundle_share_each_graphs_onnx_runtime_session_and_keep_their_own_caches(onnx_bundle,
                                                                                                   tmp_path):
    """Two Sessions of one bundle (the bench's plain decoding and a drafter's configuration, a node reconfigured)
    run the target on one ORT session (one copy of the weights, one thread pool: neither is faster for where its
    copy landed), each with its own bindings and KV arena: interleaved, each emits what it emits alone."""
    alone = {d: [Session.open(onnx_bundle, drafter=d, backend="onnx", max_context=256).generate(
        p, GenerationParams(max_tokens=16)).token_ids for p in PROMPTS] for d in ("none", "draft_model")}
    plain = Session.open(onnx_bundle, drafter="none", backend="onnx", max_context=256)
    spec = Session.open(onnx_bundle, drafter="draft_model", backend="onnx", max_context=256)
    assert plain.target.session is spec.target.session
    assert plain.arena is not spec.arena
    for i, prompt in enumerate(PROMPTS):  # a request of each, in turns, twice
        for _ in range(2):
            assert plain.generate(prompt, GenerationParams(max_tokens=16)).token_ids == alone["none"][i]
            assert spec.generate(prompt, GenerationParams(max_tokens=16)).token_ids == alone["draft_model"][i]
    assert alone["none"] == alone["draft_model"]  # greedy: speculation changes nothing
    plain.close()
    assert spec.generate(PROMPTS[0], GenerationParams(max_tokens=16)).token_ids == alone["none"][0]
    # a profiled session is its own (ORT's profiler writes per session)
    from runtime.backends.onnx_net import open_session
    path = spec.target.model_path
    assert open_session(path, threads=spec.target.threads, profile_prefix=str(tmp_path / "p")) is not spec.target.session


def test_a_graph_rewritten_on_disk_opens_as_a_new_session(onnx_bundle, tmp_path):
    from runtime.backends.onnx_net import open_session
    src = Session.open(onnx_bundle, drafter="none", backend="onnx", max_context=64).target.model_path
    path = str(tmp_path / os.path.basename(src))
    for ext in ("", ".data"):
        if os.path.isfile(src + ext):
            shutil.copy(src + ext, path + ext)
    first = open_session(path, threads=2)
    assert open_session(path, threads=2) is first
    assert open_session(path, threads=1) is not first  # other settings: another session
    os.utime(path, ns=(1, 1))  # the file changed under the process (a re-export)
    assert open_session(path, threads=2) is not first
