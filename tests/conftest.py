import pytest

from tests.support.tiny_bundle import make_tiny_bundle


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> str:
    """Path of a tiny random-weight bundle (target 3 layers, draft 1 layer, real BPE tokenizer)."""
    return make_tiny_bundle(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_fp16_graph(tiny_bundle, tmp_path_factory):
    """(spec, path) of the tiny bundle's target exported as an fp16 ONNX graph (taps: final_norm): the graph
    TensorRT engines are built from (tests/runtime/backends/test_tensorrt.py, tests/export/tensorrt/test_quantize.py)."""
    from export.onnx.graph import export_target_onnx
    from runtime.model import bundle as bundle_mod
    from runtime.model.tensors import read_safetensors

    b = bundle_mod.load(tiny_bundle)
    weights = read_safetensors(b.path(b.target.backends["numpy_ref"].files[0]))
    path = str(tmp_path_factory.mktemp("fp16_graph") / "target.fp16.onnx")
    export_target_onnx(b.target.spec, weights, path, ("final_norm",), "fp16")
    return b.target.spec, path
