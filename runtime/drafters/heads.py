"""One runner for a drafter head with a KV cache of its own: EAGLE's draft layer, an MTP module, DFlash's block
forward. The head runs its new rows either in numpy (the oracle each export is checked against) or on its ONNX
graph (runtime/backends/onnx_net.OnnxNet); either way their K/V land in the cache right after its valid rows
and the cache's length moves past the rows that persist. The drafters differ only in what a row computes, which
each passes in; where the rows go, the room check and the write-back are here, once."""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

import numpy as np

from runtime.backends.onnx_net import OnnxNet
from runtime.errors import BundleError
from runtime.memory.kv import KVCache

T = TypeVar("T")


def kv_names(layers: Optional[int]) -> List[Tuple[str, str, int]]:
    """(key suffix, value suffix, cache layer) of a head graph's K/V: a one-layer graph (layers None: EAGLE, an MTP
    module) names them past_key / past_value -> new_key / new_value; a graph of `layers` layers (DFlash)
    past_key_{i} ... new_value_{i}. Example: kv_names(2) -> [("_key_0", "_value_0", 0), ("_key_1", "_value_1", 1)]."""
    if layers is None:
        return [("_key", "_value", 0)]
    return [(f"_key_{i}", f"_value_{i}", i) for i in range(layers)]


def run_on_cache(net, feeds: Mapping[str, np.ndarray], cache: KVCache, rows: int,
                 layers: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Run a head's graph on its own KV cache: `feeds` plus the past K/V (rows [0, cache.length)) of each layer,
    then write the graph's new K/V for `rows` rows right after them. The caller checks the room and moves
    cache.length (which rows persist is the drafter's own rule; `HeadRunner.run` does both). Returns the
    graph's outputs."""
    start = cache.length
    names = kv_names(layers)
    feeds = dict(feeds)
    for k, v, i in names:
        feeds["past" + k], feeds["past" + v] = cache.k[:start, i], cache.v[:start, i]  # (start, nkv, d)
    got = net.run(feeds)
    for k, v, i in names:
        cache.k[start:start + rows, i] = got["new" + k]  # (rows, nkv, d)
        cache.v[start:start + rows, i] = got["new" + v]
    return got


class HeadRunner:
    """A head's cache and, optionally, its graph. `inputs` / `outputs`: what the drafter feeds and reads besides
    the K/V, checked against a graph when it is set (an older export is refused at load, naming what it lacks)."""

    def __init__(self, cache: KVCache, net=None, layers: Optional[int] = None, inputs: Sequence[str] = (),
                 outputs: Sequence[str] = ()):
        self.cache = cache
        self.layers = layers  # None: a one-layer graph (past_key / new_key); else its layer count
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.net = net

    @property
    def net(self):
        return self._net

    @net.setter
    def net(self, net) -> None:
        if net is not None:
            net.require(self.inputs + tuple("past" + s for k, v, _ in kv_names(self.layers) for s in (k, v)),
                        self.outputs + tuple("new" + s for k, v, _ in kv_names(self.layers) for s in (k, v)))
        self._net = net

    @property
    def on_graph(self) -> bool:
        return self._net is not None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the graph's weights (0 on numpy: the drafter counts its own arrays)."""
        return 0 if self._net is None else int(self._net.weight_bytes)

    def run(self, rows: int, numpy_step: Callable[[int], T], graph_feeds: Callable[[int], Mapping[str, np.ndarray]],
            graph_result: Callable[[Dict[str, np.ndarray]], T], keep: Optional[int] = None,
            use_graph: bool = True) -> T:
        """Run `rows` new cache rows from the cache's length `start` on: on the graph (when there is one and
        `use_graph`) with graph_feeds(start), its new K/V written back, its outputs turned into the result by
        graph_result; else numpy_step(start), which writes its K/V rows start.. itself. Then the first `keep`
        of them (all by default) persist: cache.length = start + keep. A graph returns the K/V of those rows only.

        Example: DFlash runs c context rows and a block of b temporary rows: rows = c + b, keep = c; EAGLE's
        T rows all stay (accept drops the drafted ones later)."""
        start = self.cache.length
        self.cache.check_room(rows)
        keep = rows if keep is None else keep
        if self._net is not None and use_graph:
            out = graph_result(run_on_cache(self._net, graph_feeds(start), self.cache, keep, self.layers))
        else:
            out = numpy_step(start)
        self.cache.length = start + keep
        return out


def head_graphs(b, label: str, count: int = 1, unit: str = "head") -> Optional[List[OnnxNet]]:
    """The `count` ONNX graphs (in the order the entry lists them) of the drafter entry being built (b: a
    DrafterBuild), when the session runs on ONNX Runtime and the entry has graphs; None = run the head in numpy.
    An entry whose onnx files are not `count` graphs is refused, naming the command that re-exports them."""
    files = b.entry.backends.get("onnx") if b.backend.kind == "onnx" else None
    if files is None:
        return None
    kstep = files.params.get("kstep_graph")
    graphs = [f for f in files.files if f.endswith(".onnx") and f != kstep]
    if len(graphs) != count:
        raise BundleError(f"{b.bundle.path('bundle.yaml')}: drafters.{b.name}.backends.onnx lists {len(graphs)} "
                          f"graphs for {count} {unit}; re-export with "
                          f"`edgespec export --to onnx --bundle {b.bundle.root}`")
    return [OnnxNet(b.bundle.path(g), b.backend.providers, b.backend.threads,
                    label=label if count == 1 else f"{label} {i}", spinning=b.backend.spinning)
            for i, g in enumerate(graphs)]


class HeadKStep:
    """A head's K-step chain graph (export/drafters/eagle_kstep.py: the catch-up rows, K draft steps, their logits
    processing and draws in ONE run) on the head's own cache, whose K/V rows it writes as `run_on_cache` does.
    `has_confidence` is always true for these graphs (they were born with the output); a drafter asks it through
    `shared.kstep_fits` as it asks the draft model's."""

    def __init__(self, model_path: str, steps: int, providers: Sequence[str] = ("CPUExecutionProvider",),
                 threads: int = 0, spinning: str = "never", label: str = "K-step head"):
        self.net = OnnxNet(model_path, providers, threads, label=label, spinning=spinning)
        self.net.require(("input_ids", "features", "position_ids", "uniforms", "past_key", "past_value"),
                         ("tokens", "q", "confidence", "new_key", "new_value"))
        self.model_path, self.steps, self.has_confidence = model_path, int(steps), True
        mask = self.net.session.get_inputs()[self.net.input_names.index("logit_mask")]
        self.vocab = int(mask.shape[0])  # the target's vocabulary (static in the graph)
        from runtime.backends.onnx_kstep import uniforms_dtype

        self.uniforms_dtype = uniforms_dtype(self.net.session)

    def run(self, cache: KVCache, tokens: Sequence[int], features: np.ndarray, positions: np.ndarray, params,
            history: Sequence[int], uniforms: np.ndarray):
        """Run the T rows (features f_t, tokens x_{t+1}) the cache lacks and draft K tokens after them ->
        runtime.backends.onnx_kstep.KStepChain; the cache grows by T + K - 1 rows (the K-th token is not run)."""
        from runtime.backends.onnx_kstep import KStepChain, param_feeds

        t = len(tokens)
        rows = t + self.steps - 1
        cache.check_room(rows)
        feeds = {"input_ids": np.asarray(tokens, np.int64), "features": np.asarray(features, np.float32),
                 "position_ids": np.asarray(positions, np.int64), "uniforms": np.asarray(uniforms, self.uniforms_dtype),
                 **param_feeds(params, history, self.vocab)}
        got = run_on_cache(self.net, feeds, cache, rows)
        cache.length += rows
        return KStepChain(got["tokens"], got["q"], got["confidence"])


def head_kstep(b, mode: str, label: str) -> Optional[HeadKStep]:
    """The K-step chain graph of the drafter entry being built (its onnx entry's params kstep_graph / kstep_steps)
    when the mode runs it on this backend (`shared.kstep_runs`), else None (the step-wise chain)."""
    from runtime.drafters.shared import kstep_runs

    files = b.entry.backends.get("onnx")
    rel = files.params.get("kstep_graph") if files is not None else None
    if not rel or not kstep_runs(mode, b.backend):
        return None
    return HeadKStep(b.bundle.path(rel), int(files.params.get("kstep_steps", 1)), b.backend.providers,
                     b.backend.threads, b.backend.spinning, label)
