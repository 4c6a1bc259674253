"""`backend: auto` runs the bundle's ONNX graphs where it can; where it cannot, it falls back to numpy_ref and
says so in one line on stderr naming why (no ONNX target graph and the command that adds it, exports it does
not run by itself, onnxruntime missing), never silently."""
from __future__ import annotations

import shutil
from dataclasses import replace

from runtime.backends.factory import auto_fallback_reason, resolve_backend
from runtime.model import bundle as bundle_io
from runtime.model.bundle import BackendFiles


def _with_backends(b, **entries):
    backends = dict(b.target.backends, **{k.replace("__", "."): BackendFiles(("x",), p) for k, p in entries.items()})
    return replace(b, target=replace(b.target, backends=backends))


def test_auto_without_an_onnx_graph_says_why_and_how_to_add_one(tiny_bundle):
    b = bundle_io.load(tiny_bundle)
    said = []
    assert resolve_backend("auto", b, note=said.append) == "numpy_ref"
    assert len(said) == 1 and "\n" not in said[0]
    assert "running numpy_ref" in said[0] and "has no ONNX target graph" in said[0]
    assert f"edgespec export --to onnx --bundle {tiny_bundle}" in said[0]


def test_auto_names_the_exports_it_does_not_run_by_itself(tiny_bundle):
    b = _with_backends(bundle_io.load(tiny_bundle), gguf={"quant": "f16"}, gguf__q8_0={"quant": "q8_0"})
    reason = auto_fallback_reason(b, "auto", have_onnxruntime=True)
    assert "its gguf, gguf.q8_0 entries run only when named (--backend gguf)" in reason


def test_auto_with_onnx_graphs_but_no_onnxruntime_says_so(tiny_bundle):
    b = _with_backends(bundle_io.load(tiny_bundle), onnx={"precision": "fp32"})
    assert auto_fallback_reason(b, "auto", have_onnxruntime=True) is None
    assert "onnxruntime is not installed" in auto_fallback_reason(b, "auto", have_onnxruntime=False)


def test_auto_with_a_quantised_precision_looks_for_that_graph(tiny_bundle):
    b = _with_backends(bundle_io.load(tiny_bundle), onnx={"precision": "fp32"})
    reason = auto_fallback_reason(b, "int8", have_onnxruntime=True)
    assert "has no int8 ONNX target graph" in reason and "--precision int8" in reason
    assert auto_fallback_reason(_with_backends(b, onnx__int8={"precision": "int8"}), "int8", True) is None


def test_a_session_on_auto_prints_the_reason_on_stderr_once(tiny_bundle, tmp_path, capsys):
    from runtime.serving.session import Session

    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    for _ in range(2):
        Session.open(root, backend="auto", drafter="none", max_context=32).close()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("backend auto:")]
    assert len(lines) == 1 and "has no ONNX target graph" in lines[0]
