"""The DFlash-2 block forward as an ONNX graph (export/drafters/dflash_onnx.py, run through
runtime/backends/onnx_net.py OnnxNet) computes what the numpy drafter computes (max relative |diff| <= 1e-4
over several cycles and both block sizes: the context K/V the graph returns are what the numpy path would
have cached), a wrong graph is refused by the export's check, and greedy decoding with the graph-backed
drafter is token-identical to plain decoding."""
import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from export.drafters.dflash_onnx import TOLERANCE, compare_with_numpy, export_and_check  # noqa: E402
from runtime.backends.onnx_net import OnnxNet  # noqa: E402
from runtime.decode.engine import Engine  # noqa: E402
from runtime.errors import ExportError  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from tests.runtime.drafters.test_dflash import V, build, official_config, official_weights, target  # noqa: E402,F401


def _ck(v2):
    from runtime.drafters.dflash import DFlashParams
    from runtime.model.spec import ModelSpec

    cfg = official_config(v2, block=9)
    return (ModelSpec.from_hf_config(cfg), DFlashParams.from_dict(dict(cfg["dflash_config"], block_size=9), "t"),
            official_weights(v2))


@pytest.fixture(scope="module", params=[True], ids=["dflash2"])
def exported(request, tmp_path_factory, target):
    """(v2, checkpoint, graph path), exported once (an export costs ~30 s of CPU here). DFlash-2 only: its graph
    is DFlash's plus the local mixing; a plain DFlash graph is checked the same way by every export into a
    bundle (export_and_check, e.g. the zoo bundle's)."""
    spec, weights = target
    v2 = request.param
    dspec, params, w = _ck(v2)
    _, drafter = build(spec, weights, v2, block=9)
    path = str(tmp_path_factory.mktemp("graph") / "d.onnx")
    export_and_check(dspec, params, w, path, "test", drafter.embed, drafter.head)  # checks <= TOLERANCE itself
    return v2, (dspec, params, w), path


def test_graph_equals_the_numpy_drafter_and_decodes_greedy_identically(target, exported):
    spec, weights = target
    v2, (dspec, params, w), path = exported
    tgt, drafter = build(spec, weights, v2, block=9)
    assert compare_with_numpy(dspec, params, w, path, drafter.embed, drafter.head, cycles=4, seed=1) <= TOLERANCE
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, V, 7)]
    plain = Engine(tgt, None).generate(prompt, SamplingParams(), 24).tokens
    tgt, drafter = build(spec, weights, v2, block=9)
    drafter.net = OnnxNet(path, label="dflash")
    calls = []
    run = drafter.net.run
    drafter.net.run = lambda feeds: calls.append(1) or run(feeds)
    out = Engine(tgt, drafter).generate(prompt, SamplingParams(), 24)
    assert out.tokens == plain and out.stats.cycles > 0 and calls  # the graph drafted


def test_export_refuses_a_graph_that_differs_from_the_numpy_drafter(tmp_path, target, exported, monkeypatch):
    """The graph is checked against the numpy drafter of the weights being exported: here the graph of other
    weights (norm x 1.01) stands in for a wrong export."""
    import shutil

    from export.drafters import dflash_onnx

    spec, weights = target
    v2, (dspec, params, w), path = exported
    _, drafter = build(spec, weights, v2, block=9)

    def stale_graph(_spec, _params, _weights, out):
        for suffix in ("", ".data"):
            shutil.copyfile(path + suffix, out + suffix)
        return out

    monkeypatch.setattr(dflash_onnx, "export_dflash_onnx", stale_graph)
    skewed = dict(w, **{"norm.weight": w["norm.weight"] * 1.01})
    with pytest.raises(ExportError, match="differ from the numpy drafter"):
        export_and_check(dspec, params, skewed, str(tmp_path / "d.onnx"), "test", drafter.embed, drafter.head)
