"""Specification of `edgespec bundle add-drafter | remove-drafter | set-prompts` (export/bundle/edit.py): an edit
keeps every file whose inputs it did not change (same bytes, same mtime) and exports only what the change touched;
it deletes only files the manifest lists as the bundle's and no other entry uses; a failed edit leaves the bundle
exactly as it was; files the user put in the bundle directory survive every edit.

One tiny bundle with ONNX graphs (exported once for the module) is copied per test; copies keep mtimes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from export.bundle.edit import add_drafters, remove_drafters, set_prompts
from runtime.errors import BundleError, ExportError
from runtime.model import bundle as bundle_io
from runtime.model.bundle import BundleWriter, sha256_of
from tests.support import REPO_ROOT
from tests.support.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint

pytestmark = pytest.mark.slow
PROMPT = "<|bos|><|text|>the robot picks up the red cup"
TARGET_GRAPH = ("onnx/target.fp32.onnx", "onnx/target.fp32.onnx.data")
USER_FILE = "my notes.md"  # not a data format: never listed, never ours


@pytest.fixture(scope="module")
def onnx_bundle(tmp_path_factory):
    """(bundle with fp32 ONNX graphs of the target and draft model, EAGLE-1 head dir, EAGLE-3 head dir)."""
    from export.onnx.bundle import add_onnx_to_bundle
    from tests.support.tiny_bundle import make_tiny_bundle

    base = tmp_path_factory.mktemp("edits")
    root = make_tiny_bundle(str(base))
    add_onnx_to_bundle(root, "fp32", validate=False)
    spec = bundle_io.load(root).target.spec
    return root, eagle1_checkpoint(str(base / "eagle1"), spec), eagle3_checkpoint(str(base / "eagle3"), spec)


def _copy(src: str, tmp_path) -> str:
    root = str(tmp_path / "bundle")
    shutil.copytree(src, root)  # copy2: mtimes kept, so "unchanged" means unchanged by the edit
    with open(os.path.join(root, USER_FILE), "w") as f:
        f.write("the user's file\n")
    return root


def _files(root: str) -> dict:
    """{listed file: (sha256, mtime_ns)} of a bundle."""
    return {rel: (sha256_of(os.path.join(root, rel)), os.stat(os.path.join(root, rel)).st_mtime_ns)
            for rel in bundle_io.load(root).files}


def _tree(root: str) -> dict:
    """{every path under root: its bytes (None for folders)}."""
    out = {}
    for d, dirs, names in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = None
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def _greedy(root: str, drafter: str):
    from runtime.serving.session import GenerationParams, Session

    s = Session.open(root, drafter=drafter, backend="onnx", max_context=96)
    try:
        net = type(getattr(s.drafter, "net", None)).__name__
        return s.generate(PROMPT, GenerationParams(max_tokens=12)).token_ids, net
    finally:
        s.close()


def _no_leftovers(root: str) -> None:
    parent = os.path.dirname(root)
    assert not [n for n in os.listdir(parent) if ".edit-" in n]
    assert not [n for n in os.listdir(root) if n.startswith(".onnx-export")]


# -- add-drafter ---------------------------------------------------------------------------------------

def test_add_drafter_keeps_every_file_byte_identical_and_exports_only_the_new_heads_graph(onnx_bundle, tmp_path):
    src, eagle1, _ = onnx_bundle
    root = _copy(src, tmp_path)
    before = _files(root)
    assert add_drafters(root, eagle=eagle1, validate=False, report=lambda line: None) == ["eagle", "eagle2"]
    after = _files(root)
    assert {rel: after[rel] for rel in before} == before  # the target graph among them: same sha, same mtime
    assert set(after) - set(before) == {"eagle/eagle.safetensors", "onnx/drafter.eagle.fp32.onnx",
                                        "onnx/drafter.eagle.fp32.onnx.data"}
    b = bundle_io.load(root)
    assert b.drafters["eagle2"].backends["onnx"].files == ("onnx/drafter.eagle.fp32.onnx",
                                                          "onnx/drafter.eagle.fp32.onnx.data")
    tokens, net = _greedy(root, "eagle2")
    assert net == "OnnxNet" and tokens == _greedy(root, "none")[0]  # drafts on its graph, exactly
    assert os.path.isfile(os.path.join(root, USER_FILE))
    _no_leftovers(root)


def test_a_drafter_reading_taps_the_target_graph_lacks_has_the_onnx_graphs_exported_and_engines_dropped(onnx_bundle, tmp_path):
    src, _, eagle3 = onnx_bundle
    root = _copy(src, tmp_path)
    w = BundleWriter.extend(root)  # an engine built from the old target graph (a stand-in: no GPU needed)
    with open(w.path("tensorrt/target.engine"), "wb") as f:
        f.write(b"engine bytes")
    w.add_target_backend("tensorrt", ["tensorrt/target.engine"], {"precision": "fp32"})
    w.write()
    before = _files(root)
    said = []
    add_drafters(root, eagle3=eagle3, validate=False, report=said.append)
    b = bundle_io.load(root)
    assert "tensorrt" not in b.target.backends and not os.path.exists(os.path.join(root, "tensorrt"))
    assert any("removed the tensorrt entries (tensorrt/target.engine)" in line and "rebuild them on the device" in line
               for line in said)
    assert set(b.drafters["eagle3"].target_taps) <= set(b.target.backends["onnx"].params["taps"])
    assert _files(root)[TARGET_GRAPH[0]][0] != before[TARGET_GRAPH[0]][0]
    assert _files(root)["target/model.safetensors"] == before["target/model.safetensors"]
    assert any("has no taps" in line and "exporting the ONNX graphs again" in line for line in said)
    tokens, net = _greedy(root, "eagle3")
    assert net == "OnnxNet" and tokens == _greedy(root, "none")[0]


def test_adding_a_drafter_the_bundle_has_is_refused_and_changes_nothing(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    draft = os.path.join(os.path.dirname(src), "draft")
    before = _tree(root)
    with pytest.raises(BundleError, match="already has a drafter named 'draft_model'; remove it first"):
        add_drafters(root, draft=draft, report=lambda line: None)
    assert _tree(root) == before
    _no_leftovers(root)


def test_a_failed_edit_leaves_the_bundle_exactly_as_it_was(onnx_bundle, tmp_path, monkeypatch):
    """The head's weights and manifest entry are written before its graph's export fails: none of it shows."""
    import export.onnx.bundle as onnx_bundle_mod

    src, eagle1, _ = onnx_bundle
    root = _copy(src, tmp_path)
    before = _tree(root)
    stat = {rel: os.stat(os.path.join(root, rel)).st_mtime_ns for rel in before}

    def fail(*args, **kwargs):
        raise ExportError("the graph disagrees with numpy (a test's failure)")

    monkeypatch.setattr(onnx_bundle_mod, "add_onnx_to_bundle", fail)
    with pytest.raises(ExportError, match="a test's failure"):
        add_drafters(root, eagle=eagle1, report=lambda line: None)
    assert _tree(root) == before
    assert {rel: os.stat(os.path.join(root, rel)).st_mtime_ns for rel in before} == stat
    bundle_io.load(root)
    _no_leftovers(root)


# -- remove-drafter ------------------------------------------------------------------------------------

def test_remove_drafter_removes_only_the_files_no_other_drafter_uses(onnx_bundle, tmp_path):
    src, eagle1, _ = onnx_bundle
    root = _copy(src, tmp_path)
    add_drafters(root, eagle=eagle1, validate=False, report=lambda line: None)
    before = _files(root)
    assert remove_drafters(root, ["eagle"], report=lambda line: None) == []  # eagle2 reads the same files
    assert _files(root) == before and "eagle" not in bundle_io.load(root).drafters
    removed = remove_drafters(root, ["eagle2"], report=lambda line: None)
    assert removed == ["eagle/eagle.safetensors", "onnx/drafter.eagle.fp32.onnx", "onnx/drafter.eagle.fp32.onnx.data"]
    after = _files(root)
    assert after == {rel: v for rel, v in before.items() if rel not in removed}
    assert not os.path.exists(os.path.join(root, "eagle"))  # the folder it emptied
    assert os.path.isfile(os.path.join(root, USER_FILE))
    _no_leftovers(root)


def test_removing_the_default_drafter_removes_its_graph_keeps_the_target_and_picks_ngram_and_it_can_come_back(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    assert bundle_io.load(root).default_drafter == "draft_model"
    before = _files(root)
    said = []
    removed = remove_drafters(root, ["draft_model"], report=said.append)
    assert removed == ["draft/model.safetensors", "onnx/drafter.draft_model.fp32.onnx",
                       "onnx/drafter.draft_model.fp32.onnx.data"]  # its step graph (an fp32 export has no K-step one)
    b = bundle_io.load(root)
    assert b.default_drafter == "ngram" and any("default drafter is now ngram" in line for line in said)
    assert {rel: _files(root)[rel] for rel in TARGET_GRAPH} == {rel: before[rel] for rel in TARGET_GRAPH}
    # and added back: its graph alone is exported, sharing the kept target graph's vocab matrices
    add_drafters(root, draft=os.path.join(os.path.dirname(src), "draft"), validate=False, report=lambda line: None)
    after = _files(root)
    assert set(after) == set(before) and all(after[rel] == before[rel] for rel in before if rel not in removed)
    assert bundle_io.load(root).drafters["draft_model"].backends["onnx"].files == tuple(removed[1:])
    assert _greedy(root, "draft_model")[0] == _greedy(root, "none")[0]


def test_a_file_the_manifest_does_not_list_is_never_removed(onnx_bundle, tmp_path):
    src, eagle1, _ = onnx_bundle
    root = _copy(src, tmp_path)
    add_drafters(root, eagle=eagle1, validate=False, report=lambda line: None)
    mine = os.path.join(root, "eagle", "why I trained it.md")  # in the drafter's folder, not a data format
    with open(mine, "w") as f:
        f.write("mine\n")
    remove_drafters(root, ["eagle", "eagle2"], report=lambda line: None)
    assert os.path.isfile(mine) and not os.path.exists(os.path.join(root, "eagle", "eagle.safetensors"))


def test_removing_a_drafter_the_bundle_lacks_names_the_ones_it_has(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    with pytest.raises(BundleError, match=r"no drafter 'medusa'; it has \['draft_model', 'ngram'\]"):
        remove_drafters(root, ["medusa"], report=lambda line: None)


# -- set-prompts ---------------------------------------------------------------------------------------

def test_set_prompts_records_the_new_template_and_touches_no_weight(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    before = _files(root)
    planner = tmp_path / "planner.yaml"
    planner.write_text(yaml.safe_dump({"raw": "<|bos|><|plan|>{{ instruction }} -- carefully<|sep|>"}))
    set_prompts(root, {"planner_file": str(planner)}, report=lambda line: None)
    b = bundle_io.load(root)
    assert "carefully" in b.prompts.tasks["planner"].raw
    assert "text" in b.prompts.tasks and b.prompts.eos_tokens  # the rest of the format as it was
    assert _files(root) == before  # the manifest is not a listed file: every weight, graph, tokenizer kept


def test_set_prompts_with_a_bad_token_is_refused_and_changes_nothing(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    before = _tree(root)
    bad = tmp_path / "prompts.yaml"
    bad.write_text(yaml.safe_dump({"prompts": {"eos_tokens": ["<|no such token|>"]}}))
    with pytest.raises(BundleError, match="not a token of the model's tokenizer.json"):
        set_prompts(root, {"prompts_file": str(bad)}, report=lambda line: None)
    assert _tree(root) == before
    _no_leftovers(root)


# -- the command -----------------------------------------------------------------------------------------

def _edgespec(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True, env=env)


def test_the_bundle_subcommands_run_and_their_mistakes_are_one_line_errors(onnx_bundle, tmp_path):
    src, _, _ = onnx_bundle
    root = _copy(src, tmp_path)
    ok = _edgespec("bundle", "remove-drafter", "--bundle", root, "draft_model")
    assert ok.returncode == 0, ok.stderr
    assert "draft_model" not in bundle_io.load(root).drafters
    for args, says in ((("bundle", "add-drafter", "--bundle", root), "name the drafter to add"),
                       (("bundle", "remove-drafter", "--bundle", root, "eagle9"), "no drafter 'eagle9'"),
                       (("bundle", "set-prompts", "--bundle", root), "give what to change"),
                       (("bundle", "--out", str(tmp_path / "new")), "--target required to build a bundle")):
        r = _edgespec(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_bundle_in_a_folder_it_cannot_write_is_refused_before_anything_is_written(onnx_bundle, tmp_path,
                                                                                    monkeypatch):
    import export.bundle.edit as edit

    src, eagle1, _ = onnx_bundle
    root = _copy(src, tmp_path)
    before = _tree(root)
    parent = os.path.realpath(str(tmp_path))
    real_access = os.access
    # a read-only parent, as root (which writes anywhere) would not see it
    monkeypatch.setattr(edit.os, "access", lambda p, mode: False if p == parent else real_access(p, mode))
    with pytest.raises(BundleError, match="not writable; an edit writes its copy"):
        add_drafters(root, eagle=eagle1, report=lambda line: None)
    monkeypatch.undo()
    assert _tree(root) == before and sorted(os.listdir(tmp_path)) == ["bundle"]


# -- GGUF ----------------------------------------------------------------------------------------------

def test_a_draft_model_added_to_a_bundle_with_gguf_gets_its_gguf_and_the_targets_stays(tmp_path):
    pytest.importorskip("gguf", reason="the `gguf` package (export extra) is not installed")
    from export.gguf.writer import add_gguf_to_bundle
    from tests.support.tiny_bundle import make_tiny_bundle

    root = make_tiny_bundle(str(tmp_path / "g"), tokenizer_vocab=700)
    add_gguf_to_bundle(root, "f16", validate=False)
    remove_drafters(root, ["draft_model"], report=lambda line: None)
    assert not os.path.exists(os.path.join(root, "gguf", "drafter.draft_model.f16.gguf"))
    before = _files(root)
    add_drafters(root, draft=str(tmp_path / "g" / "draft"), validate=False, report=lambda line: None)
    after = _files(root)
    assert {rel: after[rel] for rel in before} == before  # gguf/target.f16.gguf among them
    assert set(after) - set(before) == {"draft/model.safetensors", "gguf/drafter.draft_model.f16.gguf"}
    assert bundle_io.load(root).drafters["draft_model"].backends["gguf"].files == ("gguf/drafter.draft_model.f16.gguf",)
