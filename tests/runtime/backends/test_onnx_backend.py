"""The ONNX export + ONNX Runtime backend equal the numpy reference (max rel error <= 1e-4 in fp32,
<= 1e-2 in fp16) for prefill, decode, tree-masked verify and after keep()/rollback, on tiny random
models of every family; batched (tree) greedy verification emits exactly the tokens of token-by-token
decoding; the KV arena is bound by pointer (the new K/V land in it, the past is never copied)."""
from tests.support import REPO_ROOT
import os

import numpy as np
import pytest

from export.onnx.graph import export_target_onnx
from runtime.model import bundle as bundle_mod
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.backends.onnx import OnnxTarget
from runtime.errors import BackendError
from runtime.memory.kv import KVArena
from runtime.model.tensors import write_safetensors
from tests.support.hf_tiny import FAMILY_CONFIGS, rel_err, tiny_hf_model

TOL = 1e-4
FP16_TOL = 1e-2  # float16 weights/activations/KV: measured ~3e-3 on these models
FAMILIES = list(FAMILY_CONFIGS)
VOCAB = 97  # tests/support/hf_tiny.py
TAPS = ("final_norm", "layer_in.0", "layer_in.2", "layer_out.1")


def arena_cache(spec, positions=96, dtype=np.float32):
    return KVArena.for_context({"target": cache_shape(spec)}, positions, dtype).allocate("target", cache_shape(spec), positions)


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    """(spec, weights, onnx path) per family; exported once per module (dynamo export ~10 s each)."""
    _, spec, weights = tiny_hf_model(request.param, seed=FAMILIES.index(request.param))
    path = str(tmp_path_factory.mktemp("onnx") / f"{request.param}.onnx")
    export_target_onnx(spec, weights, path, taps=TAPS)
    return spec, weights, path


@pytest.fixture(scope="module")
def exported_fp16(tmp_path_factory):
    _, spec, weights = tiny_hf_model("qwen3", seed=7)
    path = str(tmp_path_factory.mktemp("onnx16") / "qwen3.fp16.onnx")
    export_target_onnx(spec, weights, path, taps=("final_norm",), precision="fp16")
    return spec, weights, path


def pair(spec, weights, path, dtype=np.float32, taps=TAPS):
    return (OnnxTarget(spec, path, arena_cache(spec, dtype=dtype), tap_names=taps),
            NumpyTarget(spec, weights, arena_cache(spec)))


def assert_same(a, b, taps=(), tol=TOL):
    assert rel_err(a.logits, b.logits) <= tol
    for t in taps:
        assert rel_err(a.taps[t], b.taps[t]) <= tol, t


def tree_inputs(spec, p, rng):
    """Flattened tree r -> (a -> c, b): rows r a b c at depths 0 1 1 2, after a p-row cache."""
    tokens = rng.integers(0, spec.vocab_size, 4)
    positions = np.array([p, p + 1, p + 1, p + 2])
    anc = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    return tokens, positions, np.concatenate([np.ones((4, p), bool), anc], axis=1)


def test_prefill_decode_tree_and_rollback_match_numpy_reference(exported):
    spec, weights, path = exported
    ort, ref = pair(spec, weights, path)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, 70)  # long enough to reach the llama3 rope bands
    assert_same(ort.forward(prompt, np.arange(70), taps=TAPS), ref.forward(prompt, np.arange(70), taps=TAPS), TAPS)
    for i in range(3):  # decode
        tok = rng.integers(0, spec.vocab_size, 1)
        assert_same(ort.forward(tok, np.array([70 + i]), taps=TAPS), ref.forward(tok, np.array([70 + i]), taps=TAPS), TAPS)
    p = ort.cache_len
    tokens, positions, mask = tree_inputs(spec, p, rng)  # tree verify
    assert_same(ort.forward(tokens, positions, mask, TAPS), ref.forward(tokens, positions, mask, TAPS), TAPS)
    for t in (ort, ref):
        t.keep(p, [p, p + 1, p + 3])  # accept r -> a -> c: row p+3 moves to p+2
    nxt = rng.integers(0, spec.vocab_size, 2)
    assert_same(ort.forward(nxt, np.array([p + 3, p + 4]), taps=TAPS), ref.forward(nxt, np.array([p + 3, p + 4]), taps=TAPS), TAPS)
    for t in (ort, ref):
        t.keep(60, [])  # roll back into the prompt
    tok = rng.integers(0, spec.vocab_size, 1)
    assert_same(ort.forward(tok, np.array([60])), ref.forward(tok, np.array([60])))
    assert ort.cache_len == ref.cache_len == 61


def test_new_kv_rows_are_written_into_the_arena_and_match_the_reference(exported):
    spec, weights, path = exported
    ort, ref = pair(spec, weights, path)
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, 20)
    ort.forward(prompt[:12], np.arange(12))
    ref.forward(prompt[:12], np.arange(12))
    ort.forward(prompt[12:], np.arange(12, 20))
    ref.forward(prompt[12:], np.arange(12, 20))
    for i in range(spec.num_layers):
        k, v = ort.layer_kv(i)  # views of the arena bytes, layer-major
        assert np.shares_memory(k, ort.cache.k)
        assert rel_err(k, ref.cache.k[:20, i]) <= TOL
        assert rel_err(v, ref.cache.v[:20, i]) <= TOL
        assert not ort.k[i, 20:].any()  # nothing written past the new rows


def test_past_kv_is_bound_by_pointer_into_the_arena_without_a_copy(exported):
    """Each layer's past is bound at its block's start in the arena and the new rows right after it."""
    spec, weights, path = exported
    ort = OnnxTarget(spec, path, arena_cache(spec))
    inputs, outputs = {}, {}

    def recording(bind, seen):
        def record(name, dtype, shape, ptr):
            seen[name] = (tuple(shape), ptr)
            bind(name, dtype, shape, ptr)
        return record

    ort._bind_input, ort._bind_output = recording(ort._bind_input, inputs), recording(ort._bind_output, outputs)
    # the K/V binders (the same host binders on the CPU provider, device ones with an OrtValue arena)
    ort._bind_kv_in, ort._bind_kv_out = recording(ort._bind_kv_in, inputs), recording(ort._bind_kv_out, outputs)
    ort.forward(np.arange(10), np.arange(10))
    ort.forward(np.array([3, 4]), np.array([10, 11]))
    row = spec.num_kv_heads * spec.head_dim * 4
    block = ort.cache.max_positions * row  # one layer's rows
    kv_row = (spec.num_kv_heads, spec.head_dim)
    for i in range(spec.num_layers):
        assert inputs[f"past_key_{i}"] == ((10, *kv_row), ort.cache.k.ctypes.data + i * block)
        assert inputs[f"past_value_{i}"] == ((10, *kv_row), ort.cache.v.ctypes.data + i * block)
        assert outputs[f"new_key_{i}"] == ((2, *kv_row), ort.cache.k.ctypes.data + i * block + 10 * row)
        assert outputs[f"new_value_{i}"] == ((2, *kv_row), ort.cache.v.ctypes.data + i * block + 10 * row)


def test_fp16_graph_matches_numpy_reference_within_fp16_tolerance(exported_fp16):
    spec, weights, path = exported_fp16
    ort, ref = pair(spec, weights, path, np.float16, ("final_norm",))
    assert ort.cache.k.dtype == np.float16
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, spec.vocab_size, 30)
    assert_same(ort.forward(prompt, np.arange(30), taps=["final_norm"]),
                ref.forward(prompt, np.arange(30), taps=["final_norm"]), ["final_norm"], FP16_TOL)
    tokens, positions, mask = tree_inputs(spec, 30, rng)
    out = ort.forward(tokens, positions, mask)
    assert out.logits.dtype == np.float32
    assert_same(out, ref.forward(tokens, positions, mask), (), FP16_TOL)


def test_fp16_graph_refuses_a_float32_arena(exported_fp16):
    spec, _, path = exported_fp16
    with pytest.raises(BackendError, match="float16"):
        OnnxTarget(spec, path, arena_cache(spec))


def test_missing_provider_raises_backend_error_naming_it_and_what_to_install(exported):
    spec, _, path = exported
    with pytest.raises(BackendError, match="CUDAExecutionProvider.*onnxruntime-gpu"):
        OnnxTarget(spec, path, arena_cache(spec), providers=("CUDAExecutionProvider", "CPUExecutionProvider"))


def test_asking_for_a_tap_that_was_not_exported_raises(exported):
    spec, _, path = exported
    with pytest.raises(BackendError, match="layer_out.0"):
        OnnxTarget(spec, path, arena_cache(spec), tap_names=("layer_out.0",))
    ort = OnnxTarget(spec, path, arena_cache(spec), tap_names=("final_norm",))
    with pytest.raises(BackendError, match="layer_in.0"):
        ort.forward(np.arange(3), np.arange(3), taps=["layer_in.0"])


def greedy_decode(target, prompt, n):
    target.reset()
    logits = target.forward(prompt, np.arange(len(prompt))).logits[-1]
    out = [int(np.argmax(logits))]
    while len(out) < n:
        logits = target.forward(np.array(out[-1:]), np.array([len(prompt) + len(out) - 1])).logits[0]
        out.append(int(np.argmax(logits)))
    return out


def greedy_tree_decode(target, prompt, n, oracle, rng):
    """Speculative greedy decoding with a 2-branch draft tree per step (one chain is the true
    continuation corrupted at random, the other a random token), verified in ONE forward each step."""
    target.reset()
    target.forward(prompt[:-1], np.arange(len(prompt) - 1))
    out, cur = [], int(prompt[-1])
    while len(out) < n:
        p = target.cache_len
        truth = (oracle + [0] * 8)[len(out):len(out) + 4]
        chain = [t if rng.random() < 0.7 else int(rng.integers(0, VOCAB)) for t in truth]
        tokens = np.array([cur, *chain, int(rng.integers(0, VOCAB))])  # rows: root, chain 1..4, side branch
        parents = [-1, 0, 1, 2, 3, 0]
        depth = [0, 1, 2, 3, 4, 1]
        anc = np.eye(6, dtype=bool)
        for i in range(6):
            j = parents[i]
            while j >= 0:
                anc[i, j] = True
                j = parents[j]
        mask = np.concatenate([np.ones((6, p), bool), anc], axis=1)
        logits = target.forward(tokens, p + np.array(depth), mask).logits
        node, rows = 0, [p]
        while True:
            best = int(np.argmax(logits[node]))
            out.append(best)
            kids = [i for i in range(6) if parents[i] == node and tokens[i] == best]
            if not kids or len(out) >= n:
                break
            node = kids[0]
            rows.append(p + node)
        target.keep(p, rows)
        cur = out[-1]
    return out[:n]


def assert_tree_greedy_identity(target, spec, prompts: int, seed: int = 3) -> None:
    """`prompts` random prompts, 12 tokens each, a 6-node tree per step: tree verification on `target` emits exactly
    the token-by-token greedy tokens."""
    rng = np.random.default_rng(seed)
    for _ in range(prompts):
        prompt = rng.integers(0, spec.vocab_size, int(rng.integers(2, 30)))
        plain = greedy_decode(target, prompt, 12)
        assert greedy_tree_decode(target, prompt, 12, plain, rng) == plain


def test_tree_verification_emits_the_same_tokens_as_token_by_token_greedy_decoding(exported):
    """50 random prompts per family, 12 tokens each: exact token identity (fp32)."""
    spec, weights, path = exported
    assert_tree_greedy_identity(OnnxTarget(spec, path, arena_cache(spec)), spec, 50)


def test_export_cli_adds_target_and_draft_model_graphs_to_a_bundle(tmp_path, capsys):
    """`edgespec export --to onnx` exports the target and the draft model (one more decoder stack),
    storing a vocab matrix the draft shares with the target only once; both then run from ONE arena,
    each on its own view."""
    from runtime.cli import main

    _, spec, weights = tiny_hf_model("llama", seed=11, num_layers=2)
    _, dspec, dweights = tiny_hf_model("qwen3", seed=12, num_layers=1)
    dweights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]  # as a distilled draft may
    root = str(tmp_path / "bundle")
    w = bundle_mod.BundleWriter(root, "tiny")
    write_safetensors(os.path.join(root, "target.safetensors"), weights)
    write_safetensors(os.path.join(root, "draft.safetensors"), dweights)
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        f.write("{}")
    w.set_target(spec)
    w.add_target_backend("numpy_ref", ["target.safetensors"])
    w.add_drafter("draft", "draft_model", files=["draft.safetensors"], spec=dspec, default=True)
    w.set_tokenizer("tokenizer.json")
    w.write()
    assert main(["export", "--to", "onnx", "--bundle", root, "--taps", "final_norm", "layer_out.0"]) == 0
    assert "max rel error" in capsys.readouterr().out
    b = bundle_mod.load(root)
    target_files, draft_files = b.target_files("onnx"), b.drafter("draft").backends["onnx"]
    assert target_files.params == {"precision": "fp32", "taps": ["final_norm", "layer_out.0"], "attention": "fused",
                                   "kv_layout": "layer_head_major"}  # the default for a float target
    assert draft_files.params["kv_layout"] == "layer_major"
    embed = weights["model.embed_tokens.weight"].nbytes
    draft_data = os.path.getsize(b.path(draft_files.files[0]) + ".data")
    assert draft_data <= sum(a.nbytes for a in dweights.values()) - embed  # the embedding lives in the target's file
    arena = KVArena.for_context({"target": cache_shape(spec), "draft": cache_shape(dspec)}, 40)
    target = OnnxTarget(spec, b.path(target_files.files[0]), arena.allocate("target", cache_shape(spec), 40),
                        tap_names=("layer_out.0",))
    draft = OnnxTarget(dspec, b.path(draft_files.files[0]), arena.allocate("draft", cache_shape(dspec), 40), tap_names=())
    prompt = np.arange(1, 30) % VOCAB
    for model, mspec, mweights in ((target, spec, weights), (draft, dspec, dweights)):
        ref = NumpyTarget(mspec, mweights, arena_cache(mspec))
        assert_same(model.forward(prompt, np.arange(29)), ref.forward(prompt, np.arange(29)))
        assert_same(model.forward(prompt[:3], np.arange(29, 32)), ref.forward(prompt[:3], np.arange(29, 32)))
    from runtime.commands.bench_backend import run as bench

    report = "\n".join(bench([root, root], "onnx", [0], contexts=[8, 16], news=[1, 2], repeats=1, decode_tokens=4,
                              decode_rounds=1))
    assert "[B] time / [A] time" in report
    assert "% of bound" in report and "python overhead per decode step" in report


def test_the_robot_side_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, runtime.backends.onnx, runtime.commands.bench_backend; "
            "sys.exit(int(any(m in sys.modules for m in ('torch', 'transformers', 'export'))))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def test_exporting_another_precision_replaces_the_entry_and_leaves_no_orphan_file(tiny_bundle, tmp_path, capsys):
    """One ONNX entry per model: fp16 after fp32 removes the fp32 graphs the manifest listed, so every file
    on disk is one the manifest lists, and the session runs the fp16 graphs."""
    import shutil

    from runtime.cli import main
    from runtime.serving.session import GenerationParams, Session

    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    assert main(["export", "--to", "onnx", "--bundle", root, "--no-validate"]) == 0
    assert main(["export", "--to", "onnx", "--bundle", root, "--precision", "fp16", "--no-validate"]) == 0
    assert "onnx/target.fp32.onnx: removed (replaced by the fp16 export)" in capsys.readouterr().out
    b = bundle_mod.load(root)
    on_disk = {os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns}
    assert on_disk == set(b.files) | {"bundle.yaml"}, "no orphan files"
    assert b.target_files("onnx").params["precision"] == "fp16"
    assert not any("fp32" in f for f in b.files)
    s = Session.open(root, drafter="draft_model", backend="onnx", max_context=64)
    assert s.generate("<|bos|><|text|>the robot", GenerationParams(max_tokens=4)).stats.backend == "onnx"


def test_export_refuses_a_graph_that_differs_from_the_reference_and_leaves_the_bundle_unchanged(
        tiny_bundle, tmp_path, capsys, monkeypatch):
    """An exporter bug (simulated: the graph is built from a final-norm weight scaled by 1.5) must fail
    `edgespec export` with exit code 2 and one line naming the graph, its error and the tolerance; the
    bundle's manifest and files (here an earlier good fp32 export) stay byte for byte as they were."""
    import shutil

    import export.onnx.bundle as onnx_bundle
    from runtime.cli import main

    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    assert main(["export", "--to", "onnx", "--bundle", root, "--no-validate"]) == 0

    def snapshot():
        return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
                for d, _, names in os.walk(root) for n in names}

    before = snapshot()
    real = onnx_bundle.export_graph

    def wrong_graph(spec, weights, out_path, taps, precision, attention):
        weights = {**weights, "model.norm.weight": weights["model.norm.weight"] * 1.5}
        return real(spec, weights, out_path, taps, precision, attention)

    monkeypatch.setattr(onnx_bundle, "export_graph", wrong_graph)  # where the bundle export builds float graphs
    capsys.readouterr()
    assert main(["export", "--to", "onnx", "--bundle", root]) == 2
    err = capsys.readouterr().err
    assert "onnx/target.fp32.onnx (target): the exported fp32 graph differs from the numpy reference by" in err
    assert "fp32 allows 1e-04" in err and "left unchanged" in err and "Traceback" not in err
    assert snapshot() == before
    monkeypatch.undo()  # the right graph replaces the same-named entry, validated
    assert main(["export", "--to", "onnx", "--bundle", root]) == 0
    bundle_mod.load(root)
