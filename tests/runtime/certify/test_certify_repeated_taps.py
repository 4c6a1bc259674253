"""`certify` with an EAGLE-3 head on a 4-layer target, whose default tap layers (2, N//2, N-3) repeat a layer
([1, 2, 2] as the loader sorts them): the memoising target gathers each named tap once, as the backends do
for generate and bench, so the drafter gets one row per position and the run reaches a verdict (it used to
stack that tap's rows twice: "ValueError: ... size 23 and ... size 46"). alpha 0.001, DRAWS draws, fixed
seeds; the head is random (tests/support/eagle_tiny.py) on a tiny random target (V = 97)."""
import numpy as np

from export.drafters.eagle import load_eagle
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.certify.run import certify
from runtime.decode.engine import Engine
from runtime.drafters.eagle import EagleDrafter
from runtime.memory.kv import KVArena
from runtime.sampling import SamplingParams
from tests.support.eagle_tiny import eagle3_checkpoint
from tests.support.hf_tiny import tiny_hf_model

ALPHA = 1e-3
DRAWS = 300


class Session:
    """What certify reads of a session: the engine and its drafter."""

    def __init__(self, spec, weights, head):
        shapes = {"target": cache_shape(spec), "draft": cache_shape(head.spec)}
        arena = KVArena.for_context(shapes, 128 + 64)
        self.target = NumpyTarget(spec, weights, arena.allocate("target", shapes["target"], 128))
        self.drafter = EagleDrafter(head.kind, head.spec, head.weights, weights["model.embed_tokens.weight"],
                                    weights["lm_head.weight"], arena.allocate("draft", shapes["draft"], 128 + 64),
                                    head.params, num_tokens=3)
        self.engine = Engine(self.target, self.drafter, eos_ids=())
        self.tokenizer = None


def test_certify_an_eagle3_head_whose_tap_layers_repeat_on_a_4_layer_target_reaches_a_verdict(tmp_path):
    _, spec, weights = tiny_hf_model("llama", seed=3, num_layers=4)
    head = load_eagle(eagle3_checkpoint(str(tmp_path / "e3"), spec, seed=2), spec)
    assert head.params["tap_layers"] == [1, 2, 2]  # the collision under test
    s = Session(spec, weights, head)
    assert s.drafter.target_taps == ("layer_in.1", "layer_in.2", "layer_in.2")
    (res,) = certify(s, [("4-layer target", [5, 6, 7, 8, 9])], SamplingParams(temperature=1.0), draws=DRAWS,
                     alpha=ALPHA, seed=1)
    assert res.draws == DRAWS and np.isfinite(res.first_p_value) and np.isfinite(res.pair_p_value)
    assert res.passed, res  # the exact rule passes
