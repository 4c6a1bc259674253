"""Specification: a session reads its bundle's files once, at load. Replacing or deleting them under a running
session (a re-export next to a running node) neither fails its requests nor goes unnoticed."""
from __future__ import annotations

import os
import shutil

import pytest

from runtime.serving.session import GenerationParams, Session


@pytest.fixture
def own_bundle(tiny_bundle, tmp_path):
    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    return root


def _files(root, suffixes):
    return [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(suffixes)]


@pytest.mark.parametrize("backend", ["numpy_ref", "onnx"])
def test_deleting_the_loaded_files_fails_no_request_and_is_reported_by_name(own_bundle, backend):
    if backend == "onnx":
        from export.onnx.bundle import add_onnx_to_bundle
        add_onnx_to_bundle(own_bundle, "fp32", None, validate=False)
    s = Session.open(own_bundle, drafter="draft_model", backend=backend)
    try:
        memory = s.memory_in_use()
        assert s.changed_files() == []
        removed = _files(own_bundle, (".safetensors", ".onnx", ".data"))
        assert removed
        for path in removed:
            os.remove(path)
        res = s.plan("bring the cup", params=GenerationParams(max_tokens=4))
        assert res.stats.tokens >= 1 and res.stats.memory_bytes == memory == s.memory_in_use()
        changed = s.changed_files()
        assert changed and all(c.endswith("(missing)") for c in changed)
        assert {c.split(" ")[0] for c in changed} == {os.path.relpath(p, own_bundle) for p in removed}
    finally:
        s.close()


def test_a_rewritten_manifest_is_reported_as_modified(own_bundle):
    s = Session.open(own_bundle, drafter="none")
    try:
        path = os.path.join(own_bundle, "bundle.yaml")
        with open(path, "a") as f:
            f.write("\n# edited\n")
        assert s.changed_files() == ["bundle.yaml (modified)"]
    finally:
        s.close()
