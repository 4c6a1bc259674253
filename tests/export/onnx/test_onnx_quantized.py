"""Weight-only int8 ONNX graphs (ONNX Runtime's MatMulNBits quantiser) sit next to the float graph in one
bundle, each selected by `backend.precision`; the quantised graph IS the target: speculative greedy output
on it equals plain greedy decoding on it, token for token, for every drafter."""
import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest

from export.onnx.graph import TOLERANCE
from runtime.model import bundle as bundle_mod
from runtime.config import RuntimeConfig
from runtime.errors import BundleError
from runtime.serving.session import GenerationParams, Session

pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")

PROMPTS = ["<|bos|><|plan|>pick up the red cup<|sep|>", "<|bos|><|text|>the robot opens the drawer and the drawer",
           "<|bos|><|text|>hand the bottle to alice and place the cup on the"]


@pytest.fixture(scope="module")
def quant_bundle(tiny_bundle, tmp_path_factory):
    from export.onnx.bundle import add_onnx_to_bundle

    root = str(tmp_path_factory.mktemp("quant") / "bundle")
    shutil.copytree(tiny_bundle, root)
    add_onnx_to_bundle(root, "fp32", validate=False)
    add_onnx_to_bundle(root, "int8")  # validated against the float32 reference within TOLERANCE["int8"]
    return root


def open_session(root, precision, drafter):
    cfg = RuntimeConfig(bundle=root)
    cfg = replace(cfg, backend=replace(cfg.backend, kind="onnx", precision=precision),
                  drafter=replace(cfg.drafter, kind=drafter), memory=replace(cfg.memory, max_context=256))
    return Session(cfg)


def test_int8_graph_sits_next_to_the_float_graph_and_precision_selects_it(quant_bundle):
    b = bundle_mod.load(quant_bundle)
    assert b.onnx_target("auto").params["precision"] == b.onnx_target("fp32").params["precision"] == "fp32"
    int8 = b.onnx_target("int8")
    assert int8.params["precision"] == "int8" and int8.params["block_size"] == 32
    assert int8.params["accuracy_level"] == 4  # export/onnx/quantize.py ACCURACY_LEVEL: int8 activations
    ops = [n.op_type for n in onnx.load(b.path(int8.files[0]), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 7 * b.target.spec.num_layers  # q k v o gate up down; the LM head stays float
    assert "MatMul" in ops
    fp32, q8 = open_session(quant_bundle, "auto", "none"), open_session(quant_bundle, "int8", "none")
    assert fp32.target.model_path.endswith("target.fp32.onnx") and q8.target.model_path.endswith("target.int8.onnx")
    ids = np.array(fp32.tokenizer.encode(PROMPTS[0]))
    a = fp32.target.forward(ids, np.arange(len(ids))).logits
    c = q8.target.forward(ids, np.arange(len(ids))).logits
    assert 0 < np.abs(a - c).max() < TOLERANCE["int8"] * np.abs(a).max()  # another model, near the float one


@pytest.mark.parametrize("drafter", ["draft_model", "ngram"])
def test_speculative_greedy_on_the_int8_target_equals_plain_greedy_on_it(quant_bundle, drafter):
    plain, spec = open_session(quant_bundle, "int8", "none"), open_session(quant_bundle, "int8", drafter)
    assert spec.target.model_path.endswith("target.int8.onnx")
    for prompt in PROMPTS:
        a = plain.generate(prompt, GenerationParams(max_tokens=24))
        b = spec.generate(prompt, GenerationParams(max_tokens=24))
        assert a.token_ids == b.token_ids, prompt


def test_asking_for_a_precision_the_bundle_lacks_names_the_export_command(quant_bundle):
    with pytest.raises(BundleError, match=r"no int4 ONNX graph .*edgespec export --to onnx --precision int4"):
        open_session(quant_bundle, "int4", "none")
