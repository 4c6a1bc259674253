"""Specification of the memory plan (runtime/memory/plan.py), the Session's budget and `edgespec memory`:
the arithmetic on hand-computed dims, the published model sizes, max context monotone in the budget,
an over-budget session or request refused before any allocation, and one-line CLI errors."""
from __future__ import annotations

from tests.support import REPO_ROOT
import json
import os

import pytest

from runtime.drafters import registry
from runtime.memory import devices, plan as memory
from runtime.config import RuntimeConfig
from runtime.errors import BudgetExceeded
from runtime.memory.plan import MiB, ModelDims, PlanInputs
from runtime.serving.session import GenerationParams, Session
from tests.runtime.commands.test_cli import run_cli

ROOT = REPO_ROOT
MODELS = os.path.join(ROOT, "configs", "models")
TOY = ModelDims(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32, tie=True)


def test_plan_rows_on_known_dims_match_the_hand_computation():
    # one layer: q 8x8 + k,v 2x8x4 + o 8x8 + mlp 3x8x16 + 2 norms of 8 = 64 + 64 + 64 + 384 + 16 = 592
    assert TOY.layer_params() == 592
    assert TOY.body_params() == 2 * 592 + 8  # + the final norm
    inp = PlanInputs(TOY, precision="fp16", head_precision="fp16", kv_bytes=2, tree_tokens=5, overhead_bytes=1000,
                     headroom=0.0)
    rows = {r.name: r.bytes for r in memory.plan_rows(inp, 100, budget=10**6)}
    assert rows["target weights"] == 1192 * 2
    assert rows["target embedding + head"] == 32 * 8 * 2  # tied: the head is the embedding, counted once
    assert rows["target KV"] == 2 * 2 * 1 * 4 * 2 * (100 + memory.DRAFT_SLACK)  # K+V x layers x kv x d x fp16
    # prefill of 100 tokens over 100: 4 x (4x100x8 + max(2x2x100x100 + 100x100/4, 3x100x16, 100x32))
    assert rows["forward scratch"] == 4 * (3200 + 42500)
    assert rows["runtime overhead"] == 1000 and rows["headroom"] == 0
    assert memory.total_bytes(inp, 100, 10**6) == 2384 + 512 + 5248 + 182800 + 1000


def test_published_model_sizes_come_out_of_their_config_files():
    """Qwen3-1.7B 1.72B, Llama-3.2-3B 3.21B, Qwen3-8B 8.19B parameters (their model cards)."""
    def params(name):
        d = memory.read_hf_config(os.path.join(MODELS, name))
        return d.body_params() + d.embedding_params() + d.head_params()
    assert params("qwen3-1.7b.json") == pytest.approx(1.72e9, rel=0.01)
    assert params("llama-3.2-3b.json") == pytest.approx(3.21e9, rel=0.01)
    assert params("qwen3-8b.json") == pytest.approx(8.19e9, rel=0.01)
    assert params("llama-3.1-8b.json") == pytest.approx(8.03e9, rel=0.01)
    q = memory.read_hf_config(os.path.join(MODELS, "qwen3-1.7b.json"))
    assert memory.weight_bytes(q, "int4", "fp16") == (726_727_056, 622_329_856)  # the docstring's example
    q8 = memory.read_hf_config(os.path.join(MODELS, "qwen3-8b.json"))
    assert memory.kv_bytes_per_position([q8.cache_shape()], 2) == 147_456


def test_an_eagle3_head_shares_the_target_embedding_and_has_a_32k_head():
    head = memory.read_hf_config(os.path.join(MODELS, "qwen3-8b-eagle3.json"))
    assert head.embedding_params() == 0 and head.head_params() == 32000 * 4096 and head.layers == 1
    assert head.fusion_in == 3 * 4096 and head.attn_in == 2 * 4096


def test_max_context_grows_with_the_budget_and_sits_exactly_on_the_boundary():
    inp = PlanInputs(TOY, drafter=TOY, overhead_bytes=10_000)
    last = 0
    for budget in [5_000, 20_000, 50_000, 10**5, 10**6, 10**7, 10**8]:
        n = memory.max_context(inp, budget)
        assert n >= last
        last = n
        if n:
            assert memory.total_bytes(inp, n, budget) <= budget < memory.total_bytes(inp, n + 1, budget)
    assert memory.max_context(inp, 5_000) == 0 and last > 1000


def test_budget_strings_and_shares_of_mem_available(tmp_path):
    assert devices.parse_budget("5.5GB") == 5_500_000_000
    assert devices.parse_budget("1.5GiB") == 1_610_612_736
    assert devices.parse_budget("512MiB") == 512 * MiB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    assert devices.parse_budget("50%", meminfo=str(meminfo)) == 2_000_000 * 1024


def test_the_biggest_lever_of_an_fp16_8b_model_is_int4_weights():
    inp = PlanInputs(memory.read_hf_config(os.path.join(MODELS, "qwen3-8b.json")), fused_attention=True,
                     prefill_tokens=256)
    top = memory.levers(inp, 16 * 2**30, 4096)[0]
    assert top["lever"].startswith("int4") and top["frees_bytes"] > 4e9


# ---------------------------------------------------------------------------------------------- session

def budget_config(bundle, budget_mb, **memory_keys):
    cfg = RuntimeConfig(bundle=bundle)
    from dataclasses import replace
    return replace(cfg, backend=replace(cfg.backend, kind="numpy_ref"),
                   drafter=replace(cfg.drafter, kind="draft_model"),
                   memory=replace(cfg.memory, budget_mb=budget_mb, **memory_keys))


def test_a_session_over_budget_is_refused_with_the_numbers_before_any_allocation(tiny_bundle, monkeypatch):
    from runtime.serving import assembly  # where a Session is assembled
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the budget was checked")
    monkeypatch.setattr(assembly.KVArena, "for_context", no_allocation)
    monkeypatch.setattr(assembly, "open_model", no_allocation)
    with pytest.raises(BudgetExceeded) as exc:
        Session(budget_config(tiny_bundle, 8.0))  # less than the runtime overhead alone
    msg = str(exc.value)
    assert "memory budget 8.0 MiB cannot hold this bundle at 16 positions" in msg
    assert "runtime overhead 40.0" in msg and "Raise memory.budget_mb to at least" in msg


def test_the_arena_is_sized_from_the_plan_and_a_longer_request_is_refused_before_it_runs(tiny_bundle):
    from runtime.model import bundle as bundle_io
    inp = registry.plan_inputs(bundle_io.load(tiny_bundle), "draft_model", "numpy_ref", 5)
    budget_mb = memory.budget_needed(inp, 200) / MiB
    session = Session(budget_config(tiny_bundle, budget_mb))
    fit = memory.max_context(inp, int(budget_mb * MiB))
    assert 200 <= fit < 2048 and session.target.max_cache_len == fit
    plan = memory.make_plan(inp, int(budget_mb * MiB), fit)
    assert session.arena.capacity_bytes == plan.row("target KV") + plan.row("drafter KV")
    ids = session.tokenizer.encode("pick up the red cup " * 20)[:50]
    with pytest.raises(BudgetExceeded, match=r"cannot hold prompt \(50 tokens\) \+ max_tokens"):
        session.generate_ids(ids, GenerationParams(max_tokens=fit))
    session.generate_ids(ids, GenerationParams(max_tokens=4))  # one that fits runs


# ---------------------------------------------------------------------------------------------- CLI

BAD = [
    (["--config", "configs/models/qwen3-8b.json", "--device", "orin_nano_9gb"], "unknown device 'orin_nano_9gb'"),
    (["--config", "configs/models/qwen3-8b.json", "--budget", "5.5XB"], "--budget: got '5.5XB', expected a size"),
    (["--config", "configs/models/qwen3-8b.json", "--budget", "150%"], "--budget: got '150%'"),
    (["--config", "configs/models/nope.json"], "configs/models/nope.json: cannot read"),
    (["--bundle", "no/such/bundle"], "--bundle: no/such/bundle: no such directory"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[f[-1] for f, _ in BAD])
def test_bad_plan_input_is_one_line_naming_the_value(capsys, monkeypatch, flags, message):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(["memory", "plan"] + flags, capsys)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_json_parses_and_says_what_fits(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = run_cli(["memory", "plan", "--config", "configs/models/qwen3-8b.json", "--drafter-config",
                            "configs/models/qwen3-8b-eagle3.json", "--device", "orin_nano_8gb", "--precision", "fp16",
                            "--json"], capsys)
    r = json.loads(out)
    assert code == 1 and not r["fits"] and r["max_context"] == 0 and "does NOT fit" in r["verdict"]
    assert {row["name"] for row in r["rows"]} >= {"target weights", "drafter weights", "target KV", "drafter KV"}
    assert r["levers"][0]["frees_bytes"] > 0


def test_profile_compares_the_plan_with_the_measured_peak(tiny_bundle, capsys):
    code, out, _ = run_cli(["memory", "profile", "--bundle", tiny_bundle, "--backend", "numpy_ref", "--context", "64",
                            "--max-tokens", "4", "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["measured_peak_bytes"] > 0 and r["planned_peak_bytes"] > 0
    assert r["unaccounted_bytes"] == r["measured_peak_bytes"] - r["planned_peak_bytes"]
    assert r["kv_arena_bytes"] == r["kv_planned_bytes"] and r["projection"]["plain_tok_s_bound"] > 0


def test_plan_plot_has_a_curve_per_drafter_choice_and_is_written_atomically(tiny_bundle, tmp_path, capsys):
    from runtime.commands.memory_plot import context_curve
    inp = PlanInputs(target=memory.read_hf_config(os.path.join(ROOT, "configs/models/qwen3-1.7b.json")))
    budgets, contexts = context_curve(inp, 4 * memory.GiB, points=5)
    assert budgets == pytest.approx([1.0, 2.75, 4.5, 6.25, 8.0]) and contexts == sorted(contexts)
    assert contexts[2] == memory.max_context(inp, int(4.5 * memory.GiB))
    out = tmp_path / "plan.png"
    code, _, err = run_cli(["memory", "plan", "--bundle", tiny_bundle, "--plot", str(out)], capsys)
    assert code in (0, 1) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err
    assert os.listdir(tmp_path) == ["plan.png"]  # no temporary left behind


# ---------------------------------------------------------------------------------------------- precision, --save

def with_target_entries(b, **entries):
    """The bundle `b` with extra target backend entries {key: (params, {file: size})} (no file is read)."""
    from dataclasses import replace
    from runtime.model.bundle import BackendFiles, FileEntry
    backends, files = dict(b.target.backends), dict(b.files)
    for key, (params, sizes) in entries.items():
        backends[key.replace("_", ".")] = BackendFiles(tuple(sizes), params)
        files.update({f: FileEntry(f, "0" * 64, n) for f, n in sizes.items()})
    return replace(b, target=replace(b.target, backends=backends), files=files)


def test_int8_int4_onnx_and_gguf_entries_weigh_what_their_files_weigh(tiny_bundle):
    from runtime.model import bundle as bundle_io
    b = with_target_entries(bundle_io.load(tiny_bundle),
                            onnx_int4=({"precision": "int4"}, {"onnx/t.int4.onnx": 10_000, "onnx/t.int4.onnx.data": 990_000}),
                            gguf=({"quant": "q4_K_M", "precision": "int4"}, {"gguf/t.q4_K_M.gguf": 800_000}))
    spec = b.target.spec
    for backend, precision, total, head_precision in [("onnx", "int4", 1_000_000, "fp32"), ("gguf", "auto", 800_000, "q6_K")]:
        inp = registry.plan_inputs(b, "none", backend, 5, precision)
        rows = {r.name: r.bytes for r in memory.plan_rows(inp, 64, 10**9)}
        head = memory.math.ceil(spec.vocab_size * spec.hidden_size * memory.BYTES_PER_WEIGHT[head_precision])
        assert inp.head_precision == head_precision and rows["target embedding + head"] == head
        assert rows["target weights"] + rows["target embedding + head"] == total  # the files, split by the head's share
    assert registry.plan_inputs(b, "none", "onnx", 5, "int4").kv_bytes == 4  # a quantised graph keeps float32 K/V
    gguf = registry.plan_inputs(b, "none", "gguf", 5)
    assert gguf.kv_bytes == 2 and gguf.prefill_tokens == memory.GGUF_BATCH  # llama.cpp: f16 K/V, batches of 512
    rows = {r.name: r.bytes for r in memory.plan_rows(gguf, 1000, 10**9)}
    # one prefill chunk's logits and their concatenation (the engine keeps only the last row of each chunk)
    assert rows["prefill logits"] == 2 * 4 * memory.PREFILL_CHUNK * spec.vocab_size
    assert registry.plan_inputs(b, "none", "numpy_ref", 5).target_file_bytes is None  # widened to float32: the dims


def test_llama_cpp_quants_from_a_config_alone(capsys, monkeypatch):
    """q8_0: 34 B per 32 weights; q4_K_M: ~4.8 bits per decoder-layer weight, its head q6_K (210 B per 256)."""
    q = memory.read_hf_config(os.path.join(MODELS, "qwen3-1.7b.json"))
    assert memory.weight_bytes(q, "q8_0", "q8_0") == (1_497_498_176, 330_612_736)  # 1,409,410,048 x 34/32
    assert memory.weight_bytes(q, "q4_K_M", "q6_K") == (845_646_029, 255_252_480)  # 151936 x 2048 x 210/256
    monkeypatch.chdir(ROOT)
    code, out, _ = run_cli(["memory", "plan", "--config", "configs/models/qwen3-1.7b.json", "--precision", "q4_K_M",
                            "--device", "orin_nano_8gb", "--json"], capsys)
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert code == 0 and rows["target embedding + head"]["bytes"] == 255_252_480  # q6_K by default with q4_K_M


def test_profile_save_stores_the_measured_overhead_and_later_plans_use_it(tiny_bundle, tmp_path, capsys):
    import shutil

    import yaml
    from runtime.model import bundle as bundle_io
    copy = str(tmp_path / "b")
    shutil.copytree(tiny_bundle, copy)
    with open(os.path.join(copy, "bundle.yaml")) as f:
        before = yaml.safe_load(f)
    code, out, _ = run_cli(["memory", "profile", "--bundle", copy, "--backend", "numpy_ref", "--context", "64",
                            "--max-tokens", "4", "--save", "--json"], capsys)
    r = json.loads(out)
    with open(os.path.join(copy, "bundle.yaml")) as f:
        after = yaml.safe_load(f)
    saved = after["target"]["backends"]["numpy_ref"]["params"].pop("memory_profile")
    assert code == 0 and after == before  # nothing but the one key changed
    assert saved["runtime_overhead_bytes"] == r["measured_overhead_bytes"] > 0 and saved["context"] == 64
    assert r["measured_overhead_bytes"] == r["measured_peak_bytes"] - (r["planned_peak_bytes"] - next(
        row["bytes"] for row in r["rows"] if row["name"] == "runtime overhead"))
    assert [f for f in os.listdir(copy) if f.endswith(".tmp")] == []
    inp = registry.plan_inputs(bundle_io.load(copy), "draft_model", "numpy_ref", 5)  # checksums still hold
    assert inp.overhead_bytes == saved["runtime_overhead_bytes"] and "--save" in inp.overhead_note
    assert registry.plan_inputs(bundle_io.load(copy), "none", "onnx", 5).overhead_bytes == memory.RUNTIME_OVERHEAD["onnx"]
    code, out, _ = run_cli(["memory", "plan", "--bundle", copy, "--backend", "numpy_ref", "--json"], capsys)
    row = next(x for x in json.loads(out)["rows"] if x["name"] == "runtime overhead")
    assert row["bytes"] == saved["runtime_overhead_bytes"] and "measured by `edgespec memory profile --save`" in row["note"]


def test_plan_of_a_missing_onnx_precision_names_the_export_command(tiny_bundle, capsys):
    code, _, err = run_cli(["memory", "plan", "--bundle", tiny_bundle, "--backend", "onnx", "--precision", "int4"], capsys)
    assert code == 2 and "no int4 ONNX graph" in err and "edgespec export --to onnx --precision int4" in err


def test_device_memory_is_read_from_nvidia_smi_for_this_process_only(tmp_path, monkeypatch):
    from runtime.commands.memory import device_memory_used
    monkeypatch.setenv("PATH", str(tmp_path))
    assert device_memory_used(os.getpid()) is None  # no nvidia-smi: nothing measured, no error
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{os.getpid()}, 1500'\necho '1, 9000'\n")
    smi.chmod(0o755)
    assert device_memory_used(os.getpid()) == 1500 * MiB


STANDIN = ModelDims(hidden=1024, layers=6, heads=32, kv_heads=8, head_dim=32, intermediate=4096, vocab=3072)


def test_llama_cpp_scratch_is_its_compute_work_and_output_buffers_as_the_docstring_works_out():
    assert memory.ggml_scratch_bytes(STANDIN, 512, 2048) == 224_395_264
    assert memory.ggml_scratch_bytes(STANDIN, 512, 2047) == memory.ggml_scratch_bytes(STANDIN, 512, 1793)  # n_kv pads


@pytest.mark.parametrize("n_kv,logged_mib", [(768, 60.51), (1280, 93.51), (2304, 159.51)])
def test_llama_cpp_compute_buffer_term_matches_what_llama_cpp_logged_for_the_stand_in(n_kv, logged_mib):
    """llama.cpp's own 'compute buffer size' lines for the stand-in target (batch 512, flash attention off): the
    planned compute term (scratch minus the f16 probabilities and the output logits) is within 2 % of them."""
    t = 512
    compute = memory.ggml_scratch_bytes(STANDIN, t, n_kv) - 2 * STANDIN.heads * t * n_kv - 4 * t * STANDIN.vocab
    assert abs(compute / MiB - logged_mib) <= 0.02 * logged_mib
