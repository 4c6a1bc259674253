"""Drafter networks on ONNX Runtime: the one place a drafter's own graph (an MTP module, Medusa heads, an
EAGLE layer, a DFlash block) is opened and run, with the same session settings as the target's graph.

A drafter graph is whatever its drafter needs per call (named float32 / int64 inputs -> named outputs);
the graph's contract lives with its exporter (export/drafters/<kind>_onnx.py) and its drafter
(runtime/drafters/<kind>.py), whose numpy path stays the oracle the export is checked against.

The graph's declared input types decide: `run` casts each feed to them here, at the one boundary, so a
drafter never needs to know the precision around it. An fp16 target puts the session's KV arena (the
drafter's own cache rows with it) and its taps in float16, while EAGLE / DFlash graphs are exported
float32; ORT would refuse such a feed ("Unexpected input data type") instead of converting it.

    net = OnnxNet("bundle/onnx/drafter.mtp.fp32.onnx", threads=2)
    out = net.run({"hidden": h, "input_ids": ids, ...})   # -> {"logits": (T, V) float32, ...}

A drafter that keeps K/V for its own layers passes the past rows in as inputs (views of its KVCache rows in
the shared arena: ORT reads host numpy arrays in place) and gets only the new rows back, which it writes
into its cache itself: the graph never returns the whole cache."""
from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from runtime.errors import BackendError

_INSTALL_HINT = {
    "CUDAExecutionProvider": "install `onnxruntime-gpu` (and uninstall `onnxruntime`; they conflict) on a machine with CUDA",
    "TensorrtExecutionProvider": "install `onnxruntime-gpu` built with TensorRT (JetPack's onnxruntime wheel on a Jetson)",
    "CPUExecutionProvider": "install `onnxruntime`",
}


def import_ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendError("the onnx backend needs onnxruntime: `pip install edgespec[onnx]` "
                           "(or `onnxruntime-gpu` for the CUDA / TensorRT providers)") from exc
    return onnxruntime


def bundle_of(model_path: str) -> str:
    """The bundle directory of a graph at <bundle>/onnx/<name>.onnx (for the commands messages suggest)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(model_path)))


# ORT's intra-op pool between the operators of a run and after it: (session.intra_op.allow_spinning,
# session.force_spinning_stop). "never" (the default): threads sleep between operators, so they never take a core
# from another process or from what runs next (a drafter's graph, numpy maths): on a shared, oversubscribed CPU
# spinning threads made a step ~1.5-3x slower (measured). "run": they spin while a run lasts, so ~100 small
# operators a step do not each wake a sleeping thread, and stop the moment it returns; "always": ORT's own default,
# spinning on after a run too (onnxruntime-genai runs with it). `backend.spinning` picks one for the target
# and every drafter graph (heads, block drafters, the K-step graph).
SPINNING = {"never": ("0", "0"), "run": ("1", "1"), "always": ("1", "0")}


# Graphs open in this process, shared: (graph file, its bytes on disk, providers, threads, spinning) -> session.
# Every backend or drafter that opens the same graph with the same settings runs it on one ORT session: one copy
# of the weights and of their pre-packed forms, one thread pool. Two Sessions of one bundle (the bench's plain
# decoding and each drafter's configuration, the node reconfigured with another drafter) then run the target on
# the same memory and threads, so none is faster for where its copy of the weights landed: the bench's control
# row read 0.93-0.94x plain when each opened its own (R14), 0.99-1.01x with one (Z23, R15; BENCHMARKS.md). Each
# caller binds its own inputs and outputs (an IOBinding per backend) and ORT runs one session from several
# threads. A graph rewritten on disk is a new key (a new session loads the new file); a session is dropped once
# no backend holds it.
_OPEN: "weakref.WeakValueDictionary[Tuple, object]" = weakref.WeakValueDictionary()
_OPEN_LOCK = threading.Lock()


def _graph_key(model_path: str, providers: Sequence[str], threads: int, spinning: str) -> Tuple:
    """What makes two opens of a graph the same session: the file (and its external data) as it is on disk now,
    and the settings."""
    files = []
    for f in (model_path, model_path + ".data"):
        if os.path.isfile(f):
            st = os.stat(f)
            files.append((os.path.realpath(f), st.st_size, st.st_mtime_ns))
    return tuple(files), tuple(providers), threads, spinning


def open_session(model_path: str, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 0,
                 profile_prefix: str = "", spinning: str = "never"):
    """An ort.InferenceSession for one graph of a bundle, with the settings every edgespec graph runs under: the
    one already open in this process for the same graph and settings (`_OPEN`), else a new one; a profiled
    session (`profile_prefix`) is always its own. Raises BackendError (provider missing, no file, graph ORT
    refuses) with what to do."""
    ort = import_ort()
    available = ort.get_available_providers()
    for p in providers:
        if p not in available:
            raise BackendError(f"ONNX Runtime provider {p!r} is not available in this onnxruntime "
                               f"({ort.__version__}: {available}); {_INSTALL_HINT.get(p, 'install an onnxruntime build with it')}, "
                               "or configure providers: [CPUExecutionProvider]")
    if not os.path.isfile(model_path):
        raise BackendError(f"{model_path}: no such ONNX graph; export it with "
                           f"`edgespec export --to onnx --bundle {bundle_of(model_path)}`")
    threads = threads or os.cpu_count() or 1
    if spinning not in SPINNING:
        raise BackendError(f"spinning {spinning!r}: expected one of {sorted(SPINNING)}")
    if profile_prefix:
        return _new_session(ort, model_path, providers, threads, spinning, profile_prefix)
    key = _graph_key(model_path, providers, threads, spinning)
    with _OPEN_LOCK:
        session = _OPEN.get(key)
        if session is None:
            session = _OPEN[key] = _new_session(ort, model_path, providers, threads, spinning, "")
        return session


def _new_session(ort, model_path: str, providers: Sequence[str], threads: int, spinning: str, profile_prefix: str):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    spin, stop = SPINNING[spinning]
    opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
    opts.add_session_config_entry("session.force_spinning_stop", stop)
    if profile_prefix:  # ORT's own per-node profiler (runtime.commands.bench_backend --profile summarises it)
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    try:
        return ort.InferenceSession(model_path, opts, providers=list(providers))
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
        raise BackendError(f"{model_path}: ONNX Runtime could not load the graph ({exc}); re-export it") from exc


# ORT's input type strings -> the numpy dtype a feed must have (the types edgespec's graphs declare)
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def feed_as(value, dtype) -> np.ndarray:
    """A feed as the contiguous array of the graph's declared dtype (None: as given); copies only when needed."""
    arr = np.asarray(value)
    if dtype is not None and arr.dtype != dtype:
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


class OnnxNet:
    """One drafter graph: `run(feeds) -> {output name: array}`; checks the feeds name the graph's inputs."""

    def __init__(self, model_path: str, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 0,
                 label: str = "drafter", spinning: str = "never"):
        self.model_path = model_path
        self.label = label
        self.session = open_session(model_path, providers, threads, spinning=spinning)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.input_dtypes = {i.name: _ORT_DTYPES.get(i.type) for i in self.session.get_inputs()}

    def require(self, inputs: Sequence[str] = (), outputs: Sequence[str] = ()) -> None:
        """Refuse, at load, a graph without the inputs/outputs its drafter feeds/reads (an older export)."""
        missing = [n for n in inputs if n not in self.input_names] + [n for n in outputs if n not in self.output_names]
        if missing:
            raise BackendError(f"{self.model_path}: the {self.label} graph has no {missing[0]!r} (it has inputs "
                               f"{list(self.input_names)}, outputs {list(self.output_names)}); re-export it with "
                               f"`edgespec export --to onnx --bundle {bundle_of(self.model_path)}`")

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
        names = list(outputs) if outputs is not None else list(self.output_names)
        got = self.session.run(names, {k: feed_as(v, self.input_dtypes.get(k)) for k, v in feeds.items()})
        return dict(zip(names, got))

    @functools.cached_property  # read once, at load: a re-export next to a running node must not fail requests
    def weight_bytes(self) -> int:
        data = self.model_path + ".data"
        return os.path.getsize(self.model_path) + (os.path.getsize(data) if os.path.isfile(data) else 0)
