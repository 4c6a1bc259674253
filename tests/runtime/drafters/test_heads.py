"""The one head runner (runtime/drafters/heads.py) EAGLE, MTP and DFlash run their heads through: the same rows on
numpy or on a graph, the graph's new K/V written right after the cached rows, the room checked for every row the
call writes and the length moved past the rows that persist."""
import numpy as np
import pytest

from runtime.drafters.heads import HeadRunner, kv_names, run_on_cache
from runtime.errors import BudgetExceeded
from runtime.memory.kv import CacheShape, KVArena


def _cache(layers=2, rows=8):
    shape = CacheShape(layers, 1, 2)
    return KVArena.for_context({"d": shape}, rows).allocate("d", shape, rows)


class Net:
    """A graph of `layers` layers (None: one layer, unnumbered names) writing `rows` rows of 7s (K) and 8s (V)."""

    def __init__(self, layers, rows):
        self.layers, self.rows, self.seen, self.required = layers, rows, {}, None

    def require(self, inputs, outputs):
        self.required = (set(inputs), set(outputs))

    def run(self, feeds):
        self.seen = {k: np.array(v) for k, v in feeds.items()}
        return {"hidden": np.ones(1), **{"new" + s: np.full((self.rows, 1, 2), 7.0 if "key" in s else 8.0)
                                         for k, v, _ in kv_names(self.layers) for s in (k, v)}}


def test_kv_names_are_unnumbered_for_one_layer_and_numbered_for_several():
    assert kv_names(None) == [("_key", "_value", 0)]
    assert kv_names(2) == [("_key_0", "_value_0", 0), ("_key_1", "_value_1", 1)]


def test_a_drafter_graph_reads_the_cached_rows_and_its_new_rows_land_right_after_them():
    cache = _cache()
    cache.k[:3] = 1.0
    cache.length = 3
    net = Net(2, 2)
    got = run_on_cache(net, {"block": np.zeros(1)}, cache, 2, layers=2)
    seen = net.seen
    assert set(seen) == {"block", "past_key_0", "past_value_0", "past_key_1", "past_value_1"} and "hidden" in got
    assert seen["past_key_1"].shape == (3, 1, 2) and (seen["past_key_1"] == 1.0).all()  # the cached rows, no more
    assert (cache.k[3:5] == 7.0).all() and (cache.v[3:5] == 8.0).all() and (cache.k[5:] == 0).all()
    assert cache.length == 3  # which rows persist is the drafter's call


def test_the_runner_runs_numpy_without_a_graph_and_keeps_every_row_by_default():
    cache = _cache(layers=1)
    cache.length = 2
    starts = []
    out = HeadRunner(cache).run(3, lambda start: starts.append(start) or "numpy", None, None)
    assert (out, starts, cache.length) == ("numpy", [2], 5)


def test_on_a_graph_only_the_kept_rows_are_written_back_and_persist():
    # DFlash's call: 2 context rows persist, a block of 3 temporary rows does not
    cache = _cache()
    cache.length = 1
    net = Net(2, 2)
    runner = HeadRunner(cache, net, layers=2, inputs=("block",), outputs=("hidden",))
    out = runner.run(5, None, lambda start: {"block": np.full(1, start)}, lambda got: got["hidden"], keep=2)
    assert out.tolist() == [1.0] and net.seen["block"].tolist() == [1]  # the feeds were built for start 1
    assert (cache.k[1:3] == 7.0).all() and (cache.k[3:] == 0).all() and cache.length == 3


def test_a_graph_call_can_fall_back_to_numpy_and_a_graph_is_checked_for_its_kv_names_when_set():
    cache = _cache(layers=1)
    net = Net(None, 1)
    runner = HeadRunner(cache, net, inputs=("features",), outputs=("logits",))
    assert net.required == ({"features", "past_key", "past_value"}, {"logits", "new_key", "new_value"})
    assert runner.run(1, lambda start: "numpy", None, None, use_graph=False) == "numpy" and net.seen == {}


def test_the_room_is_checked_for_every_row_written_before_anything_runs():
    cache = _cache(layers=1, rows=4)
    cache.length = 2
    ran = []
    with pytest.raises(BudgetExceeded, match="'d' holds 4 positions; 2 used, 3 more asked"):
        HeadRunner(cache).run(3, lambda start: ran.append(start), None, None, keep=1)
    assert ran == [] and cache.length == 2
