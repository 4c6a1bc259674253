"""Medusa heads on ONNX Runtime: `edgespec export --to onnx` (export/onnx/bundle.py add_onnx_to_bundle) writes one graph
for all heads (hidden -> (K, V) logits) into the medusa drafters' `backends.onnx`, checked against the numpy heads;
a session on the onnx backend drafts through it (OnnxNet) and decodes token-identically to the numpy heads; a
graph that does not reproduce the heads is refused with ExportError."""
import os
import shutil

import numpy as np
import pytest

from export.drafters.medusa import add_medusa_to_bundle, write_medusa
from export.drafters.medusa_onnx import TOLERANCE, check_medusa_onnx
from export.onnx.bundle import add_onnx_to_bundle
from runtime.model import bundle as bundle_io
from runtime.errors import ExportError
from runtime.serving.session import GenerationParams, Session
from runtime.model.tensors import read_safetensors
from tests.runtime.drafters.test_medusa_drafter import tiny_heads


@pytest.fixture(scope="module")
def medusa_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle with Medusa heads (3 heads over its own LM head, noisy and sharp), exported to ONNX."""
    root = tmp_path_factory.mktemp("medusa_onnx")
    path = str(root / "bundle")
    shutil.copytree(tiny_bundle, path)
    b = bundle_io.load(path)
    target = read_safetensors(b.path(b.target_files("numpy_ref").files[0]))
    heads = tiny_heads(b.target.spec, target)
    write_medusa(str(root / "heads"), heads, {"medusa_num_heads": 3, "medusa_num_layers": 1})
    writer = bundle_io.BundleWriter.extend(path)
    del writer.manifest["drafters"]["draft_model"]  # not needed here: the export then writes target + heads only
    writer.manifest["default_drafter"] = "none"
    shutil.rmtree(os.path.join(path, "draft"))
    add_medusa_to_bundle(writer, str(root / "heads"), b.target.spec)
    writer.write()
    add_onnx_to_bundle(path, "fp32")
    return path, read_safetensors(os.path.join(path, "medusa", "medusa_lm_head.safetensors"))  # as stored (fp16)


def test_export_records_one_shared_graph_for_the_medusa_drafters(medusa_bundle):
    path, heads = medusa_bundle
    b = bundle_io.load(path)
    graphs = {name: list(b.drafters[name].backends["onnx"].files) for name in ("medusa", "medusa_chain")}
    assert graphs["medusa"] == graphs["medusa_chain"] == ["onnx/drafter.medusa.fp32.onnx",
                                                          "onnx/drafter.medusa.fp32.onnx.data"]
    assert check_medusa_onnx(heads, b.path(graphs["medusa"][0]), "test") <= TOLERANCE


def test_a_graph_that_does_not_reproduce_the_heads_is_refused(medusa_bundle):
    path, heads = medusa_bundle
    other = dict(heads, **{"1.0.linear.bias": heads["1.0.linear.bias"] + np.float32(0.5)})
    with pytest.raises(ExportError, match=r"differs from the numpy heads .*allowed 1e-04"):
        check_medusa_onnx(other, os.path.join(path, "onnx", "drafter.medusa.fp32.onnx"), "drafter medusa")


@pytest.mark.parametrize("drafter", ["medusa", "medusa_chain"])
def test_onnx_heads_draft_and_decode_like_the_numpy_heads(medusa_bundle, drafter):
    path, _ = medusa_bundle
    on_graph = Session.open(path, drafter=drafter, backend="onnx", max_context=96)
    on_numpy = Session.open(path, drafter=drafter, backend="numpy_ref", max_context=96)
    assert on_graph.drafter.net is not None and on_numpy.drafter.net is None
    prompt = "<|bos|><|plan|>pick up the red cup<|sep|>"
    a = on_graph.generate(prompt, GenerationParams(max_tokens=24))
    b = on_numpy.generate(prompt, GenerationParams(max_tokens=24))
    assert a.text == b.text and a.stats.tau == pytest.approx(b.stats.tau, abs=1e-9)
    assert a.stats.cycles > 0
