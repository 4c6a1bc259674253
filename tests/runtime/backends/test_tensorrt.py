"""The TensorRT path (export/tensorrt/build.py, runtime/backends/tensorrt*.py) as far as it runs without a GPU: the
optimisation profiles against the real exported graph's inputs, the device KV offsets against the ONNX backend's
own host bindings, the row moves after a verify against KVCache.keep, version checks, the bundle entries and
every error a user meets on a machine without TensorRT. What needs TensorRT and CUDA is skipped with the reason
(it runs in scripts/gpu_check.sh on a GPU machine)."""
from __future__ import annotations

from tests.support import REPO_ROOT
import importlib.util
import os
import shutil

import numpy as np
import onnx
import pytest

from export.onnx.graph import input_names
from export.tensorrt.build import (ENGINE_DIR, TIMING_CACHE, check_tensorrt_version, context_rows, engine_params,
                             engine_path, install_engines, write_bytes_atomically)
from runtime.model import bundle as bundle_mod
from runtime.drafters import registry
from runtime.memory import bundle_sizes, plan as memory
from runtime.backends.numpy_ref import cache_shape
from runtime.backends.onnx import causal_additive_mask
from runtime.backends.tensorrt_plan import (PROFILE_NAMES, cache_offsets, engine_profiles, graph_bucket, kv_addresses,
                                            padded_mask, parse_l4t_release, pick_profile, profiles_to_params,
                                            row_moves, version_mismatch)
from runtime.cli import main
from runtime.errors import BackendError, BudgetExceeded, BundleError
from runtime.memory.kv import CacheShape, KVArena
from runtime.model.tensors import read_safetensors

HAVE_GPU_STACK = all(importlib.util.find_spec(m) is not None for m in ("tensorrt", "cuda"))
NO_GPU_REASON = "needs TensorRT's Python bindings and cuda-python on a machine with an NVIDIA GPU (scripts/gpu_check.sh)"
FACTS = {"tensorrt_version": "10.3.0", "device_name": "Orin", "compute_capability": "8.7", "l4t_version": "36.4.3",
         "jetpack_version": "6.2+b77"}


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_target(tiny_fp16_graph):
    """(spec, path of the tiny target's fp16 ONNX graph), shared with tests/export/tensorrt/test_quantize.py (conftest)."""
    return tiny_fp16_graph


# ---------------------------------------------------------------------------------------------- profiles

def test_profiles_cover_every_input_of_the_exported_graph_with_its_rank_and_static_dims(tiny_target):
    spec, path = tiny_target
    graph_inputs = {i.name: i for i in onnx.load(path, load_external_data=False).graph.input}
    assert set(graph_inputs) == set(input_names(spec.num_layers))
    for prof in engine_profiles(spec.num_layers, spec.num_kv_heads, spec.head_dim, 256, 9, 128):
        assert set(prof.shapes) == set(graph_inputs), prof.name
        for name, (lo, opt, hi) in prof.shapes.items():
            dims = graph_inputs[name].type.tensor_type.shape.dim
            assert len(lo) == len(opt) == len(hi) == len(dims), name
            for d, a, b, c in zip(dims, lo, opt, hi):
                assert a <= b <= c, (prof.name, name, lo, opt, hi)
                if d.HasField("dim_value"):  # a static dim (KV heads, head_dim) is the same in min, opt and max
                    assert a == b == c == d.dim_value, (name, d.dim_value, lo, hi)


def test_the_verify_profile_holds_trees_and_the_prefill_profile_whole_prompts_over_the_whole_cache():
    verify, prefill = engine_profiles(2, 4, 32, 1024, 9, 512)
    assert (verify.name, prefill.name) == PROFILE_NAMES
    assert verify.shapes["input_ids"] == ((1,), (9,), (9,))
    assert verify.shapes["attention_mask"] == ((1, 1), (9, 521), (9, 1024))
    assert verify.shapes["past_key_1"] == ((0, 4, 32), (512, 4, 32), (1023, 4, 32))  # P = 0: the empty cache
    assert prefill.shapes["attention_mask"] == ((1, 1), (512, 512), (512, 1024))
    assert profiles_to_params((verify, prefill)) == {"verify": {"max_tokens": 9, "max_positions": 1024},
                                                     "prefill": {"max_tokens": 512, "max_positions": 1024}}
    with pytest.raises(ValueError, match="verify tokens"):
        engine_profiles(2, 4, 32, 1024, 600, 512)


def test_a_forward_picks_verify_when_it_fits_and_is_refused_by_name_when_no_profile_takes_it():
    profiles = profiles_to_params(engine_profiles(2, 4, 32, 1024, 9, 512))
    assert pick_profile(profiles, 1, 1000, "e") == 0 and pick_profile(profiles, 9, 0, "e") == 0
    assert pick_profile(profiles, 10, 0, "e") == 1 and pick_profile(profiles, 512, 512, "e") == 1
    with pytest.raises(BudgetExceeded, match="exceed the 1024 rows .* --max-context"):
        pick_profile(profiles, 5, 1020, "e")
    with pytest.raises(BackendError, match=r"600 tokens is longer than every profile \(verify <= 9, prefill <= 512\).*--prefill-tokens"):
        pick_profile(profiles, 600, 0, "e")


def test_context_rows_come_from_the_memory_plan_under_a_budget(tiny_bundle):
    b = bundle_mod.load(tiny_bundle)
    assert context_rows(b, None, None, 64) == 2048 + memory.DRAFT_SLACK
    assert context_rows(b, 300, None, 64) == 300 + memory.DRAFT_SLACK
    budget = 600 * 2**20
    rows = context_rows(b, None, budget, 64)
    assert memory.MIN_CONTEXT < rows - memory.DRAFT_SLACK < 1 << 20
    assert context_rows(b, 100, budget, 64) == 100 + memory.DRAFT_SLACK  # the smaller of the two
    with pytest.raises(BundleError, match="memory budget"):
        context_rows(b, None, 2**20, 64)


# ---------------------------------------------------------------------------------------------- device layout

def test_device_kv_addresses_are_the_onnx_backends_host_bindings_at_the_same_offsets():
    """The device buffer mirrors the host arena: with the host arena's own base address, kv_addresses gives
    exactly the pointers the ONNX backend binds (layer-major view of each cache), for target and draft."""
    shapes = {"target": CacheShape(3, 2, 16), "draft": CacheShape(1, 2, 8)}
    arena = KVArena.for_context(shapes, 40, np.float16)
    caches = {n: arena.allocate(n, s, 40) for n, s in shapes.items()}
    base = arena._buf.ctypes.data
    for name, cache in caches.items():
        s = shapes[name]
        k_off, v_off, total = cache_offsets(cache.k, cache.v)
        assert total == arena.capacity_bytes
        k = cache.k.reshape(s.num_layers, 40, s.num_kv_heads, s.head_dim)  # as runtime/backends/onnx.py views it
        v = cache.v.reshape(s.num_layers, 40, s.num_kv_heads, s.head_dim)
        for p in (0, 7, 39):
            got = kv_addresses(base, k_off, v_off, s.num_layers, 40, s.num_kv_heads * s.head_dim * 2, p)
            for i in range(s.num_layers):
                assert got[f"past_key_{i}"] == k[i].ctypes.data and got[f"past_value_{i}"] == v[i].ctypes.data
                assert got[f"new_key_{i}"] == k[i, p:].ctypes.data and got[f"new_value_{i}"] == v[i, p:].ctypes.data


@pytest.mark.parametrize("seed", range(6))
def test_row_moves_after_a_verify_give_what_kvcache_keep_gives_without_overlapping_copies(seed):
    rng = np.random.default_rng(seed)
    layers, rows, length = 3, 24, 20
    arena = KVArena.for_context({"t": CacheShape(layers, 1, 2)}, rows)
    cache = arena.allocate("t", CacheShape(layers, 1, 2), rows)
    cache.k[:] = rng.standard_normal(cache.k.shape)
    cache.length = length
    start = int(rng.integers(0, length))
    kept = sorted(rng.choice(np.arange(start, length), int(rng.integers(0, length - start + 1)), replace=False))
    device = cache.k.reshape(rows, layers, 2).transpose(1, 0, 2).copy()  # (L, rows, row): the device layout
    for src, dst, n in row_moves(start, kept):
        assert dst < src and n <= src - dst, "a 2-D device copy may not overlap itself"
        device[:, dst:dst + n] = device[:, src:src + n]
    cache.keep(start, kept)
    np.testing.assert_array_equal(device[:, :cache.length], cache.k[:cache.length].reshape(-1, layers, 2).transpose(1, 0, 2))


def test_row_moves_skip_rows_in_place_and_merge_runs_only_while_they_do_not_overlap():
    assert row_moves(10, [10, 11, 12]) == []
    assert row_moves(10, [10, 12, 15]) == [(12, 11, 1), (15, 12, 1)]
    assert row_moves(4, [7, 8, 9]) == [(7, 4, 3)]
    assert row_moves(4, [6, 7, 8]) == [(6, 4, 2), (8, 6, 1)]


def test_graph_buckets_pad_the_past_to_64_rows_and_leave_prefills_and_the_cache_end_eager():
    assert [graph_bucket(p, 1, 9, 1024) for p in (0, 1, 63, 64, 65, 960)] == [0, 64, 64, 64, 128, 960]
    assert graph_bucket(10, 10, 9, 1024) is None  # beyond the verify profile: a prefill
    assert graph_bucket(1000, 1, 9, 1024) is None  # 1024 + 1 rows would overrun the cache


def test_a_past_padded_with_stale_rows_under_the_padded_mask_gives_the_unpadded_forward(tiny_target):
    """What a captured CUDA graph runs, checked on the very graph TensorRT builds from, with ONNX Runtime: the
    past padded from P to B rows of stale (finite, large) K/V, masked -inf, gives the same logits and new K/V."""
    import onnxruntime as ort

    spec, path = tiny_target
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    p, b, t = 5, 64, 3
    kv = (spec.num_kv_heads, spec.head_dim)
    past = {f"past_{k}_{i}": rng.standard_normal((p, *kv)).astype(np.float16)
            for k in ("key", "value") for i in range(spec.num_layers)}
    feeds = {"input_ids": rng.integers(0, spec.vocab_size, t), "position_ids": np.arange(p, p + t)}
    mask = causal_additive_mask(p, t)
    plain = sess.run(None, {**feeds, "attention_mask": mask, **past})
    stale = {n: np.concatenate([a, 30 * rng.standard_normal((b - p, *kv)).astype(np.float16)]) for n, a in past.items()}
    padded = sess.run(None, {**feeds, "attention_mask": padded_mask(mask, p, b), **stale})
    for a, c in zip(plain, padded):
        np.testing.assert_allclose(a.astype(np.float32), c.astype(np.float32), rtol=0, atol=1e-3 * np.abs(a).max())
    unmasked = padded_mask(mask, p, b)
    unmasked[:, p:b] = 0  # control: stale rows left visible must change the logits
    leaked = sess.run(None, {**feeds, "attention_mask": unmasked, **stale})
    assert np.abs(leaked[0] - plain[0]).max() > 1e-2 * np.abs(plain[0]).max()


# ---------------------------------------------------------------------------------------------- versions

def test_the_l4t_release_is_read_from_nv_tegra_release():
    text = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"
    assert parse_l4t_release(text) == "36.4.3"
    assert parse_l4t_release("not a release file") is None


@pytest.mark.parametrize("key,value,what", [("tensorrt_version", "10.7.0", "TensorRT 10.3.0, this machine has 10.7.0"),
                                            ("compute_capability", "9.0", "GPU compute capability 8.7, this machine has 9.0"),
                                            ("l4t_version", "36.3.0", "L4T (JetPack) release 36.4.3")])
def test_an_engine_built_under_other_versions_is_refused_naming_both_and_the_rebuild_command(key, value, what):
    assert version_mismatch(FACTS, FACTS, "e.engine", "b") is None
    msg = version_mismatch(FACTS, {**FACTS, key: value}, "e.engine", "bundles/x")
    assert what in msg and "`edgespec export --to tensorrt --bundle bundles/x`" in msg


def test_an_engine_built_off_a_jetson_does_not_compare_l4t_releases():
    built = {**FACTS, "l4t_version": None}
    assert version_mismatch(built, {**FACTS, "l4t_version": None}, "e", "b") is None


def test_tensorrt_older_than_10_is_refused_with_what_jetpack_ships():
    check_tensorrt_version("10.3.0")
    with pytest.raises(BackendError, match="TensorRT 8.6.2 is too old.*TensorRT 10.3"):
        check_tensorrt_version("8.6.2")
    with pytest.raises(BackendError, match="cannot read"):
        check_tensorrt_version("ten")


# ---------------------------------------------------------------------------------------------- the bundle

def test_engines_are_installed_atomically_with_checksums_versions_and_profiles(tiny_bundle, tmp_path, capsys):
    """Bytes stand in for engines here: this checks the bundle writing, not TensorRT (which cannot run here)."""
    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    b = bundle_mod.load(root)
    profiles = engine_profiles(b.target.spec.num_layers, b.target.spec.num_kv_heads, b.target.spec.head_dim, 128, 9, 64)
    params = engine_params({"precision": "fp16", "taps": ["final_norm"]}, "onnx/target.fp16.onnx", "ab" * 32,
                           profiles, FACTS, True)
    drafter = next(iter(b.drafters))
    files = install_engines(root, {"target": (b"engine-a", params), drafter: (b"engine-b", {**params, "taps": []})},
                            b"timings")
    assert files == (engine_path("target"), engine_path(drafter), TIMING_CACHE)
    again = bundle_mod.load(root)  # every checksum verified
    entry = again.target.backends["tensorrt"]
    assert entry.files == (f"{ENGINE_DIR}/target.engine",)
    assert entry.params["tensorrt_version"] == "10.3.0" and entry.params["l4t_version"] == "36.4.3"
    assert entry.params["profiles"] == profiles_to_params(profiles) and entry.params["kv_layout"] == "layer_major"
    assert list(entry.params["profiles"]) == list(PROFILE_NAMES)  # the index order the runtime selects by
    assert again.drafters[drafter].backends["tensorrt"].files == (engine_path(drafter),)
    assert again.files[TIMING_CACHE].size == len(b"timings")
    assert bundle_sizes.bundle_kv_bytes(again, "tensorrt") == 2
    # the plan counts the engine's chunked prefill: its profile's 64 tokens, below memory.prefill_chunk; the
    # other backends prefill in chunks of memory.prefill_chunk
    assert registry.plan_inputs(again, "none", "tensorrt", 5).prefill_tokens == 64
    assert registry.plan_inputs(again, "none", "tensorrt", 5, prefill_chunk=32).prefill_tokens == 32
    assert registry.plan_inputs(again, "none", "numpy_ref", 5).prefill_tokens == memory.PREFILL_CHUNK
    assert not [f for f in os.listdir(os.path.join(root, ENGINE_DIR)) if f.endswith(".tmp")]
    with open(os.path.join(root, ENGINE_DIR, "target.engine"), "ab") as f:
        f.write(b"x")
    with pytest.raises(BundleError, match="target.engine: corrupt"):
        bundle_mod.load(root)


def test_a_file_the_bundle_does_not_list_is_never_overwritten(tiny_bundle, tmp_path):
    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    os.makedirs(os.path.join(root, ENGINE_DIR))
    with open(os.path.join(root, ENGINE_DIR, "target.engine"), "wb") as f:
        f.write(b"mine")
    with pytest.raises(BundleError, match="does not list it; edgespec never overwrites"):
        install_engines(root, {"target": (b"engine", {})}, b"")
    assert open(os.path.join(root, ENGINE_DIR, "target.engine"), "rb").read() == b"mine"


def test_an_atomic_write_leaves_a_hard_linked_copy_unchanged(tmp_path):
    path, link = tmp_path / "a.engine", tmp_path / "copy.engine"
    path.write_bytes(b"old")
    os.link(path, link)
    write_bytes_atomically(str(path), b"new")
    assert path.read_bytes() == b"new" and link.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["a.engine", "copy.engine"]


# ---------------------------------------------------------------------------------------------- without TensorRT

@pytest.mark.skipif(HAVE_GPU_STACK, reason="TensorRT and cuda-python are installed here")
def test_export_to_tensorrt_without_tensorrt_is_one_line_naming_it_and_how_to_get_it(tiny_bundle, tiny_target,
                                                                                        tmp_path, capsys):
    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    code, out, err = run_cli(["export", "--to", "tensorrt", "--bundle", root], capsys)
    assert code == 2 and "no ONNX graph to build engines from" in err and "--precision fp16" in err
    os.makedirs(os.path.join(root, "onnx"))
    for suffix in ("", ".data"):  # the fp16 graph of this bundle's target, registered as `export --to onnx` does
        shutil.copy(tiny_target[1] + suffix, os.path.join(root, "onnx", "target.fp16.onnx" + suffix))
    writer = bundle_mod.BundleWriter.extend(root)
    writer.add_target_backend("onnx", ["onnx/target.fp16.onnx", "onnx/target.fp16.onnx.data"],
                              {"precision": "fp16", "taps": ["final_norm"], "kv_layout": "layer_major"})
    writer.write()
    code, out, err = run_cli(["export", "--to", "tensorrt", "--bundle", root, "--precision", "fp32"], capsys)
    assert code == 2 and "the bundle's ONNX graphs are fp16" in err
    code, out, err = run_cli(["export", "--to", "tensorrt", "--bundle", root], capsys)
    assert code == 2 and err.count("\n") == 1 and "TensorRT is not available here" in err and "python3-libnvinfer" in err


@pytest.mark.skipif(HAVE_GPU_STACK, reason="TensorRT and cuda-python are installed here")
def test_generate_on_the_tensorrt_backend_without_engines_or_tensorrt_says_what_to_do(tiny_bundle, tmp_path, capsys):
    code, out, err = run_cli(["generate", "--prompt", "x", "--bundle", tiny_bundle, "--backend", "tensorrt"], capsys)
    assert code == 2 and "no files for backend 'tensorrt'" in err
    assert f"`edgespec export --to tensorrt --bundle {tiny_bundle}`" in err
    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    b = bundle_mod.load(root)
    profiles = engine_profiles(b.target.spec.num_layers, b.target.spec.num_kv_heads, b.target.spec.head_dim, 128, 9, 64)
    install_engines(root, {"target": (b"engine", engine_params({"precision": "fp32"}, "x.onnx", "0", profiles, FACTS,
                                                                True))}, b"")
    code, out, err = run_cli(["generate", "--prompt", "x", "--bundle", root, "--backend", "tensorrt",
                              "--drafter", "none"], capsys)
    assert code == 2 and "TensorRT is not available here" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- with TensorRT

@pytest.mark.skipif(not HAVE_GPU_STACK, reason=NO_GPU_REASON)
def test_tensorrt_engine_matches_the_numpy_reference_and_keeps_the_accepted_rows(tiny_bundle, tmp_path):
    from export.onnx.bundle import add_onnx_to_bundle
    from export.tensorrt.build import add_tensorrt_to_bundle
    from runtime.backends.factory import open_model
    from runtime.backends.numpy_ref import NumpyTarget
    from runtime.config import BackendConfig

    root = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, root)
    add_onnx_to_bundle(root, "fp32", validate=False)
    add_tensorrt_to_bundle(root, max_context=64, verify_tokens=4, prefill_tokens=8, workspace_mb=256)
    b = bundle_mod.load(root)
    spec = b.target.spec
    weights = read_safetensors(b.path(b.target.backends["numpy_ref"].files[0]))
    shape = cache_shape(spec)
    arena = KVArena.for_context({"t": shape, "r": shape}, 128)
    trt_model = open_model(b, spec, b.target.backends["tensorrt"], BackendConfig(kind="tensorrt"),
                           arena.allocate("t", shape, 128))
    ref = NumpyTarget(spec, weights, arena.allocate("r", shape, 128))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, spec.vocab_size, 20)
    a, r = trt_model.forward(prompt, np.arange(20)), ref.forward(prompt, np.arange(20))  # 3 prefill chunks of <= 8
    np.testing.assert_allclose(a.logits, r.logits, rtol=0, atol=2e-3 * np.abs(r.logits).max())
    tree = np.concatenate([np.ones((4, 20), bool), np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                                                             bool)], axis=1)
    toks, pos = rng.integers(0, spec.vocab_size, 4), np.array([20, 21, 21, 22])
    a, r = trt_model.forward(toks, pos, tree), ref.forward(toks, pos, tree)
    np.testing.assert_allclose(a.logits, r.logits, rtol=0, atol=2e-3 * np.abs(r.logits).max())
    trt_model.keep(20, [20, 21, 23])
    ref.keep(20, [20, 21, 23])
    k, v = trt_model.layer_kv(0)
    np.testing.assert_allclose(k, ref.cache.k[:23, 0], atol=1e-3)
    np.testing.assert_allclose(v, ref.cache.v[:23, 0], atol=1e-3)


def test_the_gpu_configs_select_the_cuda_provider_and_the_tensorrt_backend():
    from runtime.config import load_config

    configs = os.path.join(REPO_ROOT, "configs")
    jetson = load_config(os.path.join(configs, "runtime_jetson.yaml"))
    assert jetson.backend.kind == "onnx" and jetson.backend.providers[0] == "CUDAExecutionProvider"
    assert jetson.backend.providers[-1] == "CPUExecutionProvider"
    assert "TensorrtExecutionProvider" not in jetson.backend.providers  # rebuilds per new past length; see the file
    assert load_config(os.path.join(configs, "runtime_tensorrt.yaml")).backend.kind == "tensorrt"
