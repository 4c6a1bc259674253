"""A drafter graph (runtime/backends/onnx_net.OnnxNet) takes its feeds in the dtypes the graph declares: float16
rows (an fp16 target's taps, the fp16 KV arena's cache rows) into a float32 graph, and float32 into a float16
one, are cast at this one boundary, so no drafter needs to know the precision around it."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from runtime.backends.onnx_net import OnnxNet


def scale_graph(path: str, elem: int) -> str:
    """y = 2 * x over a (T, 3) input of element type `elem`, with int64 `positions` passed through."""
    two = helper.make_tensor("two", elem, [], [2.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Identity", ["positions"], ["pos"])], "scale",
        [helper.make_tensor_value_info("x", elem, ["T", 3]), helper.make_tensor_value_info("positions", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("y", elem, ["T", 3]), helper.make_tensor_value_info("pos", TensorProto.INT64, ["T"])],
        [two])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("graph_elem,graph_dtype,feed_dtype", [
    (TensorProto.FLOAT, np.float32, np.float16),  # fp16 target, float32 EAGLE / DFlash graph (issue 29)
    (TensorProto.FLOAT16, np.float16, np.float32),  # an fp16 drafter graph fed float32 numpy maths
    (TensorProto.FLOAT, np.float32, np.float32),
])
def test_feeds_are_cast_to_the_dtype_the_graph_declares(tmp_path, graph_elem, graph_dtype, feed_dtype):
    net = OnnxNet(scale_graph(str(tmp_path / "scale.onnx"), graph_elem), threads=1)
    assert net.input_dtypes == {"x": graph_dtype, "positions": np.int64}
    x = np.arange(6, dtype=feed_dtype).reshape(2, 3)[:, ::-1]  # a strided view, as cache rows can be
    got = net.run({"x": x, "positions": np.array([4, 5], np.int32)})
    assert got["y"].dtype == graph_dtype and got["pos"].dtype == np.int64
    np.testing.assert_array_equal(got["y"], 2 * x.astype(graph_dtype))
    np.testing.assert_array_equal(got["pos"], [4, 5])


@pytest.mark.parametrize("mode, spin, stop", [("never", "0", "0"), ("run", "1", "1"), ("always", "1", "0")])
def test_the_spinning_modes_set_ort_spinning_during_and_after_a_run(tmp_path, mode, spin, stop):
    """backend.spinning: "run" lets the pool spin between a run's operators and stops it when the run returns
    (session.force_spinning_stop), "never" never spins, "always" is ORT's default; a typo is refused by name."""
    from runtime.backends.onnx_net import open_session
    from runtime.errors import BackendError

    path = scale_graph(str(tmp_path / "scale.onnx"), TensorProto.FLOAT)
    opts = open_session(path, threads=2, spinning=mode).get_session_options()
    assert (opts.get_session_config_entry("session.intra_op.allow_spinning"),
            opts.get_session_config_entry("session.force_spinning_stop")) == (spin, stop)
    with pytest.raises(BackendError, match="spinning 'fast'"):
        open_session(path, spinning="fast")




def test_the_configured_spinning_reaches_the_targets_session(monkeypatch):
    """backend.spinning (default run) is what open_model gives the onnx target, unless a caller (bench_backend)
    names another."""
    import runtime.backends.onnx as onnx_backend
    from runtime.backends.factory import open_model
    from runtime.config import BackendConfig
    from runtime.model.bundle import BackendFiles

    got = []
    monkeypatch.setattr(onnx_backend, "OnnxTarget", lambda *a, **k: got.append(k["spinning"]))

    class Bundle:
        root = "b"
        path = staticmethod(lambda rel: rel)

    files = BackendFiles(files=("onnx/target.fp32.onnx",))
    for cfg, override in ((BackendConfig(kind="onnx"), None), (BackendConfig(kind="onnx", spinning="never"), None),
                          (BackendConfig(kind="onnx", spinning="never"), "always")):
        open_model(Bundle(), None, files, cfg, None, spinning=override)
    assert got == ["run", "never", "always"]
