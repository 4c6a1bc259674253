"""The memory plan with chunked prefill and the model's context window (runtime/memory/plan.py, `edgespec memory
plan`): the forward scratch is one prefill chunk's, not the whole prompt's; a drafter's own forward scratch is a row
of its own, sized by its head (EAGLE-3: the draft vocabulary), so "no drafter" frees what the drafter rows show;
the biggest lever names the rows it shrinks and, when the prefill scratch dominates, is the prefill chunk; max
context stops at max_position_embeddings unless asked past it by name, and says so; a context past it is refused."""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest

from runtime.drafters import registry
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError
from runtime.memory import plan as memory
from runtime.memory.plan import GiB, PlanInputs
from runtime.serving.session import Session
from tests.runtime.commands.test_cli import run_cli
from tests.support import REPO_ROOT

ZOO = os.path.join(REPO_ROOT, "build", "bundles", "zoo")
MODELS = os.path.join(REPO_ROOT, "configs", "models")
needs_zoo = pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")),
                               reason="the zoo bundle is not built (make bundles)")
CAP = ("capped at the model's max_position_embeddings 2048; set memory.exceed_max_position_embeddings: true "
       "(--exceed-max-position-embeddings) to override")


def rows(inp, context, budget=10 * GiB):
    return {r.name: r.bytes for r in memory.plan_rows(inp, context, budget)}


def qwen3_8b(**kw):
    return PlanInputs(memory.read_hf_config(os.path.join(MODELS, "qwen3-8b.json")), **kw)


def test_the_forward_scratch_of_a_long_prompt_is_that_of_one_prefill_chunk():
    inp = qwen3_8b(prefill_tokens=512, scratch_factor=memory.ONNX_SCRATCH_FACTOR)
    plan = memory.make_plan(inp, 10 * GiB, 6781)
    got = next(r for r in plan.rows if r.name == "forward scratch")
    assert got.bytes == int(memory.forward_scratch_bytes(inp.target, 512, 6781) * memory.ONNX_SCRATCH_FACTOR)
    assert got.note == "a prefill chunk of 512 tokens or a 5-token verify"
    assert got.bytes < rows(replace(inp, prefill_tokens=None), 6781)["forward scratch"] / 10


@needs_zoo
def test_a_bundle_plan_prefills_in_the_configured_chunk_on_every_backend():
    from runtime.model import bundle as bundle_io
    b = bundle_io.load(ZOO, verify_checksums=False)
    # (gguf: planned only for a bundle holding a GGUF, which the zoo bundle does not: test_gguf_quants plans it)
    for backend in ("numpy_ref", "onnx") + (("gguf",) if any(k.startswith("gguf") for k in b.target.backends) else ()):
        assert registry.plan_inputs(b, "none", backend, 5).prefill_tokens == 512
        assert registry.plan_inputs(b, "none", backend, 5, prefill_chunk=64).prefill_tokens == 64
    plan = rows(registry.plan_inputs(b, "eagle3", "onnx", 5, prefill_chunk=64), 2000)
    assert plan["drafter scratch"] < plan["forward scratch"] * 2  # the drafter's catch-up is chunked too


def test_an_eagle3_heads_scratch_is_its_own_row_with_logits_over_its_draft_vocabulary():
    head = memory.read_hf_config(os.path.join(MODELS, "qwen3-8b-eagle3.json"))
    inp = qwen3_8b(drafter=head, drafter_scratch=True, prefill_tokens=512, drafter_prefill_tokens=512)
    plan = rows(inp, 512)  # (a short context: there the logits, not the attention scores, are the largest term)
    want = memory.forward_scratch_bytes(replace(head, vocab=32000), 512, 512)
    assert plan["drafter scratch"] == want < memory.forward_scratch_bytes(head, 512, 512) / 2
    # "no drafter" frees exactly the drafter's rows, each of them shown
    lever = next(x for x in memory.levers(inp, 10 * GiB, 512) if x["lever"].startswith("no drafter"))
    drafter_rows = ("drafter weights", "drafter KV", "drafter scratch")
    assert lever["frees_bytes"] == sum(plan[r] for r in drafter_rows) and set(lever["rows"]) == set(drafter_rows)


def test_when_the_prefill_scratch_dominates_the_biggest_lever_is_the_prefill_chunk_and_names_that_row():
    """The issue's case: an ONNX plan whose one-forward prefill of 6781 tokens is ~90 % of the budget; it used to
    name "fp16 KV cache" (a few MiB) as the biggest lever."""
    inp = qwen3_8b(precision="int4", kv_bytes=4, scratch_factor=memory.ONNX_SCRATCH_FACTOR, prefill_tokens=None)
    plan = rows(inp, 6781)
    assert plan["forward scratch"] > 0.7 * sum(plan.values())
    top = memory.levers(inp, 10 * GiB, 6781)[0]
    assert top["lever"].startswith("memory.prefill_chunk") and top["rows"][0] == "forward scratch"


@needs_zoo
def test_the_plan_output_names_the_biggest_row_and_the_rows_the_biggest_lever_frees(capsys):
    code, out, _ = run_cli(["memory", "plan", "--bundle", ZOO, "--budget", "512MiB", "--drafter", "eagle3",
                            "--prefill-chunk", "100000"], capsys)
    assert "biggest row: forward scratch" in out
    # a chunk of 100000 is a prefill of the whole planned context (the header's positions; it moves with the bundle's
    # weight bytes, so it is read back, not written down)
    positions = int(re.search(r"at (\d+) positions", out).group(1))
    assert f"biggest lever: memory.prefill_chunk 256 (prefill forwards of 256 tokens, not {positions})" in out, out
    assert "(forward scratch, drafter scratch;" in out


@needs_zoo
def test_max_context_stops_at_max_position_embeddings_and_the_plan_says_how_to_go_past_it(capsys):
    code, out, _ = run_cli(["memory", "plan", "--bundle", ZOO, "--budget", "4GiB", "--drafter", "none"], capsys)
    assert code == 0 and f"verdict: fits: max context 2048 ({CAP})" in out
    code, out, _ = run_cli(["memory", "plan", "--bundle", ZOO, "--budget", "4GiB", "--drafter", "none", "--json"],
                           capsys)
    assert json.loads(out)["max_context_capped_at"] == 2048
    code, out, _ = run_cli(["memory", "plan", "--bundle", ZOO, "--budget", "4GiB", "--drafter", "none",
                            "--exceed-max-position-embeddings", "--json"], capsys)
    r = json.loads(out)
    assert r["max_context"] > 2048 and r["max_context_capped_at"] is None


def test_a_config_plan_is_capped_at_the_configs_max_position_embeddings():
    q = memory.read_hf_config(os.path.join(MODELS, "qwen3-1.7b.json"))
    inp = PlanInputs(q, prefill_tokens=512, fused_attention=True)
    assert q.max_positions == 40960
    plan = memory.make_plan(inp, 1 << 40)
    assert plan.max_context == 40960 and plan.capped_at == 40960
    assert memory.max_context(replace(inp, exceed_max_positions=True), 1 << 40) == memory.CONTEXT_LIMIT


@needs_zoo
def test_a_plan_context_past_max_position_embeddings_is_one_line_naming_flag_value_limit_and_override(capsys):
    code, out, err = run_cli(["memory", "plan", "--bundle", ZOO, "--context", "200000"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--context 200000: above the model's max_position_embeddings 2048" in err
    assert "memory.exceed_max_position_embeddings: true (--exceed-max-position-embeddings)" in err


@needs_zoo
def test_max_context_past_the_models_window_is_refused_by_name_and_allowed_when_asked(capsys):
    """The zoo target was trained for 2048 positions: the issue's `--max-context 200000`."""
    code, out, err = run_cli(["generate", "--bundle", ZOO, "--backend", "numpy_ref", "--drafter", "none",
                              "--max-context", "200000", "--prompt", "hello"], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert ("memory.max_context (--max-context) 200000: above the model's max_position_embeddings 2048" in err
            and "memory.exceed_max_position_embeddings: true (--exceed-max-position-embeddings)" in err)
    cfg = RuntimeConfig(bundle=ZOO)
    cfg = replace(cfg, backend=replace(cfg.backend, kind="numpy_ref"), drafter=replace(cfg.drafter, kind="none"))
    assert Session(cfg).target.max_cache_len == 2048
    wide = replace(cfg, memory=replace(cfg.memory, max_context=4096, exceed_max_position_embeddings=True))
    assert Session(wide).target.max_cache_len == 4096
    with pytest.raises(ConfigError, match="memory.max_context"):
        Session(replace(cfg, memory=replace(cfg.memory, max_context=4096)))


def test_the_default_max_context_is_cut_to_a_shorter_model_window_not_refused():
    from runtime.serving.session import context_positions
    from runtime.config import MemoryConfig
    inp = PlanInputs(replace(memory.read_hf_config(os.path.join(MODELS, "qwen3-1.7b.json")), max_positions=512))
    assert context_positions(MemoryConfig(), inp) == 512
    with pytest.raises(ConfigError, match="max_position_embeddings 512"):
        context_positions(MemoryConfig(max_context=1024), inp)
    assert context_positions(MemoryConfig(max_context=1024, exceed_max_position_embeddings=True), inp) == 1024


def test_a_biggest_row_no_lever_shrinks_is_said_to_be_so(capsys, monkeypatch):
    """Qwen3-1.7B int4 on a 64 GB module: the KV cache of 40960 positions is the biggest row, and at that context
    no lever touches it; the plan says what does instead of letting the lever line read as the answer."""
    monkeypatch.chdir(REPO_ROOT)
    code, out, _ = run_cli(["memory", "plan", "--config", "configs/models/qwen3-1.7b.json", "--device",
                            "agx_orin_64gb", "--precision", "int4"], capsys)
    assert code == 0 and "biggest row: target KV" in out
    assert "it grows with the context: only a shorter one (memory.max_context, --context) shrinks it" in out
