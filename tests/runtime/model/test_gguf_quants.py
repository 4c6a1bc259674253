"""Several GGUF quants side by side in one bundle: each `edgespec export --to gguf --precision Q` adds its quant
(target and draft model) and keeps the others byte for byte; `backend.precision` picks one at run time (the
session opens that file, the memory plan weighs that file); a quant the bundle lacks is a one-line error
listing the quants it has and the export command that adds it.

One tiny bundle (tokenizer with merges, which llama.cpp needs) with f16 and q8_0 serves the module; q8_0 is
llama.cpp's own quantiser, so those tests need llama-cpp-python."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from runtime.drafters import registry
from runtime.config import RuntimeConfig
from runtime.errors import BundleError
from runtime.model import bundle as bundle_io
from runtime.model.bundle import sha256_of
from tests.support import REPO_ROOT

pytest.importorskip("gguf", reason="the `gguf` package (export extra) is not installed")
HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python is not installed (llama.cpp's quantiser "
                                                        "and backend)")
pytestmark = pytest.mark.slow


def _export(root: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "runtime.cli", "export", "--to", "gguf", "--bundle", root,
                           "--no-validate", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def two_quants(tmp_path_factory):
    """(bundle, {file: (sha256, mtime_ns)} of the f16 files before q8_0 was added)."""
    from tests.support.tiny_bundle import make_tiny_bundle

    root = make_tiny_bundle(str(tmp_path_factory.mktemp("quants")), tokenizer_vocab=700)
    first = _export(root)  # f16, the default
    assert first.returncode == 0, first.stderr
    f16 = {rel: (sha256_of(os.path.join(root, rel)), os.stat(os.path.join(root, rel)).st_mtime_ns)
           for rel in ("gguf/target.f16.gguf", "gguf/drafter.draft_model.f16.gguf")}
    if HAVE_LLAMA:
        second = _export(root, "--precision", "q8_0")
        assert second.returncode == 0, second.stderr
    return root, f16


@needs_llama
def test_exporting_a_second_quant_adds_it_beside_the_first_which_stays_byte_identical(two_quants):
    root, f16 = two_quants
    b = bundle_io.load(root)
    assert bundle_io.gguf_entries(b.target.backends) == {"f16": "gguf", "q8_0": "gguf.q8_0"}
    assert b.target.backends["gguf.q8_0"].files == ("gguf/target.q8_0.gguf",)
    assert b.drafters["draft_model"].backends["gguf.q8_0"].files == ("gguf/drafter.draft_model.q8_0.gguf",)
    for rel, (sha, mtime) in f16.items():  # still listed, never rewritten
        assert rel in b.files and sha256_of(b.path(rel)) == sha and os.stat(b.path(rel)).st_mtime_ns == mtime


def _session(root: str, precision: str):
    from runtime.serving.session import Session

    cfg = RuntimeConfig(bundle=root)
    return Session(replace(cfg, backend=replace(cfg.backend, kind="gguf", precision=precision, threads=1),
                           memory=replace(cfg.memory, max_context=64)))


@needs_llama
@pytest.mark.parametrize("precision,quant", [("q8_0", "q8_0"), ("int8", "q8_0"), ("f16", "f16"), ("fp16", "f16"),
                                             ("auto", "f16")])
def test_backend_precision_picks_the_quant_the_session_and_its_draft_model_open(two_quants, precision, quant):
    root, _ = two_quants
    s = _session(root, precision)
    try:
        assert s.target.model_path == os.path.join(root, f"gguf/target.{quant}.gguf")
        assert s.drafter.model.model_path == os.path.join(root, f"gguf/drafter.draft_model.{quant}.gguf")
        assert s.plan_inputs.target_file_bytes == os.path.getsize(os.path.join(root, f"gguf/target.{quant}.gguf"))
    finally:
        s.close()


@needs_llama
def test_the_memory_plan_weighs_the_chosen_quants_file(two_quants):
    root, _ = two_quants
    b = bundle_io.load(root)
    sizes = {q: os.path.getsize(b.path(f"gguf/target.{q}.gguf")) for q in ("f16", "q8_0")}
    assert sizes["q8_0"] < sizes["f16"]
    for quant in ("f16", "q8_0"):
        inp = registry.plan_inputs(b, "draft_model", "gguf", 5, quant)
        assert inp.target_file_bytes == sizes[quant]
        assert inp.precision == ("fp16" if quant == "f16" else quant)
        assert inp.drafter_precision == ("fp16" if quant == "f16" else quant)
    assert registry.plan_inputs(b, "none", "gguf", 1).target_file_bytes == sizes["f16"]  # auto: the most precise


def test_a_quant_the_bundle_lacks_is_refused_naming_the_ones_it_has_and_the_export_command(two_quants):
    root, _ = two_quants
    b = bundle_io.load(root)
    have = "f16, q8_0" if HAVE_LLAMA else "f16"
    with pytest.raises(BundleError) as exc:
        b.gguf_quant("q4_K_M")
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"no q4_K_M GGUF (it has {have})" in msg
    assert f"edgespec export --to gguf --precision q4_K_M --bundle {root}" in msg
    with pytest.raises(BundleError, match="no GGUF quant"):
        b.gguf_quant("fp32")


def test_the_cli_refuses_a_missing_quant_in_one_line_without_a_traceback(two_quants):
    root, _ = two_quants
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "memory", "plan", "--bundle", root, "--backend", "gguf",
                        "--precision", "q4_K_M"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "no q4_K_M GGUF" in r.stderr and "edgespec export --to gguf --precision q4_K_M" in r.stderr


def test_an_onnx_precision_is_not_a_gguf_quant_and_a_gguf_quant_is_not_an_onnx_graph(two_quants):
    root, _ = two_quants
    r = _export(root, "--precision", "fp32")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "no GGUF quant is fp32" in r.stderr
    with pytest.raises(BundleError, match="a GGUF quant, not an ONNX graph"):
        bundle_io.load(root).onnx_target("q8_0")


@needs_llama
def test_a_bundle_from_before_side_by_side_quants_keeps_its_quant_when_f16_is_added(two_quants, tmp_path):
    """Its one "gguf" entry held q8_0; the f16 export (whose key that is) moves it to "gguf.q8_0", untouched."""
    import shutil

    import yaml

    root = str(tmp_path / "legacy")
    shutil.copytree(two_quants[0], root)
    with open(os.path.join(root, "bundle.yaml")) as f:
        m = yaml.safe_load(f)
    for owner in (m["target"], m["drafters"]["draft_model"]):
        owner["backends"]["gguf"] = owner["backends"].pop("gguf.q8_0")
    for rel in ("gguf/target.f16.gguf", "gguf/drafter.draft_model.f16.gguf"):
        os.remove(os.path.join(root, rel))
        del m["files"][rel]
    with open(os.path.join(root, "bundle.yaml"), "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)
    q8 = sha256_of(os.path.join(root, "gguf/target.q8_0.gguf"))
    assert bundle_io.load(root).gguf_quant("auto") == "q8_0"
    r = _export(root, "--precision", "f16")
    assert r.returncode == 0, r.stderr
    b = bundle_io.load(root)
    assert bundle_io.gguf_entries(b.target.backends) == {"f16": "gguf", "q8_0": "gguf.q8_0"}
    assert bundle_io.gguf_entries(b.drafters["draft_model"].backends) == {"f16": "gguf", "q8_0": "gguf.q8_0"}
    assert sha256_of(b.path("gguf/target.q8_0.gguf")) == q8
