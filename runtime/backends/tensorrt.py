"""The TensorRT target backend: runs the engines `edgespec export --to tensorrt` builds (on the device itself:
engines are tied to the GPU and the TensorRT version), through TensorRT's Python bindings and cuda-python.

Memory. The KV cache lives in ONE device buffer per process, a mirror of the host KV arena's layout (the
arena the memory plan sized, runtime/memory/kv.py): each model's K and V sit at the same byte offsets as in the host
arena, read layer-major (L, max_positions, nkv, d) as the ONNX backend reads them, so layer i's past is the
first P rows of its block. Inputs past_key_i / new_key_i are bound by pointer into that buffer
(tensorrt_plan.kv_addresses): TensorRT reads the past in place and writes the new rows straight after it;
rollback is a smaller P, and after a tree verify `keep` moves only the accepted rows (one 2-D device copy per
run of rows, tensorrt_plan.row_moves). The host arena is never written on this backend, so its zero pages
are never faulted in (np.zeros maps them lazily): the plan's KV bytes are spent once, on the device.
Each engine has two optimisation profiles (verify, prefill: tensorrt_plan.engine_profiles) with one
execution context each; the two contexts never run at once and share one activation buffer, as large as the
larger profile needs. Everything runs on one CUDA stream with `execute_async_v3`.

CUDA graphs (backend.cuda_graphs): a graph replays fixed shapes and addresses, but the past grows by a row every
step. So a captured forward binds the past padded up to a multiple of 64 rows (the padding rows hold stale,
finite K/V and the mask gives them -inf: probability exactly 0, tensorrt_plan.padded_mask), writes its new K/V
to a fixed staging buffer, and two 2-D copies move them to rows P..P+T of the arena. One graph per (T, padded P)
then serves 64 consecutive decode steps; a forward the verify profile does not take (a prefill) runs eagerly.

Not run here: this repository is developed on machines without a GPU or TensorRT; the pure parts (profiles,
offsets, row moves, version checks) are tested there, and `scripts/gpu_check.sh` runs this class on a GPU."""
from __future__ import annotations

import functools

import ctypes
import os
import subprocess
import time
import weakref
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from runtime.backends.base import CacheRows, ForwardResult, forward_in_chunks, parse_tap
from runtime.backends.onnx import additive_mask, causal_additive_mask, tap_output_name
from runtime.backends.tensorrt_plan import (cache_offsets, graph_bucket, kv_addresses, padded_mask, parse_l4t_release,
                                            pick_profile, row_moves, version_mismatch)
from runtime.errors import BackendError, BudgetExceeded
from runtime.memory.kv import KVCache
from runtime.model.spec import ModelSpec

TENSORRT_HINT = ("TensorRT's Python bindings come with JetPack on a Jetson (`sudo apt install python3-libnvinfer`; "
                 "in the l4t-jetpack container images already), elsewhere `pip install tensorrt` from NVIDIA's index "
                 "on a machine with CUDA; or run the ONNX graphs with --backend onnx and the CUDA / TensorRT "
                 "execution providers (configs/runtime_jetson.yaml)")
CUDA_HINT = "install cuda-python (`pip install cuda-python`, matching the CUDA major version) on a machine with CUDA"
NV_TEGRA_RELEASE = "/etc/nv_tegra_release"


def import_tensorrt():
    """The tensorrt module, or a BackendError saying how to get it (the PyPI wheels without NVIDIA's index
    are stubs that fail at import)."""
    try:
        import tensorrt
        _ = tensorrt.Logger  # the stub package imports but has none of the bindings
    except (ImportError, AttributeError, OSError) as exc:
        raise BackendError(f"TensorRT is not available here ({exc.__class__.__name__}: {exc}); {TENSORRT_HINT}") from None
    return tensorrt


def import_cudart():
    """cuda-python's runtime API module (cuda.bindings.runtime since cuda-python 12.6, cuda.cudart before)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise BackendError(f"cuda-python is not available here ({exc}); {CUDA_HINT}") from None
    return cudart


def cuda_check(result, what: str):
    """Unpack a cuda-python call's (error, *values) and raise a BackendError naming the call on failure."""
    err, rest = result[0], result[1:]
    if int(err) != 0:
        raise BackendError(f"CUDA {what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else (rest or None)


def machine_facts(trt, cudart) -> Dict[str, object]:
    """What an engine is tied to, on this machine: TensorRT version, GPU, compute capability, L4T / JetPack."""
    props = cuda_check(cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    facts: Dict[str, object] = {"tensorrt_version": trt.__version__, "device_name": name,
                                "compute_capability": f"{props.major}.{props.minor}", "l4t_version": None,
                                "jetpack_version": None}
    if os.path.isfile(NV_TEGRA_RELEASE):
        with open(NV_TEGRA_RELEASE) as f:
            facts["l4t_version"] = parse_l4t_release(f.read())
        try:
            out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "nvidia-jetpack"], capture_output=True,
                                 text=True, timeout=10)
            facts["jetpack_version"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return facts


class DeviceArena:
    """One device buffer mirroring one host KV arena (runtime.memory.kv.KVArena), shared by every TensorRT model
    whose cache was carved from that arena; freed when the last of them is."""

    _live: "weakref.WeakValueDictionary[int, DeviceArena]" = weakref.WeakValueDictionary()

    def __init__(self, cudart, nbytes: int):
        self.nbytes = nbytes
        self.ptr = cuda_check(cudart.cudaMalloc(nbytes), f"cudaMalloc of the {nbytes / 2**20:.1f} MiB KV arena")
        cuda_check(cudart.cudaMemset(self.ptr, 0, nbytes), "cudaMemset of the KV arena")
        weakref.finalize(self, cudart.cudaFree, self.ptr)

    @classmethod
    def for_cache(cls, cudart, cache: KVCache) -> "DeviceArena":
        key = id(cache.k.base)
        arena = cls._live.get(key)
        if arena is None or arena.nbytes != cache.k.base.nbytes:  # (an id reused by a later host arena)
            arena = cls(cudart, cache.k.base.nbytes)
            cls._live[key] = arena
        return arena


class _Buffer:
    """A device buffer (and, with pinned=True, a page-locked host array to copy results into)."""

    def __init__(self, cudart, shape, dtype, pinned: bool = False):
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.ptr = cuda_check(cudart.cudaMalloc(max(self.nbytes, 1)), "cudaMalloc")
        weakref.finalize(self, cudart.cudaFree, self.ptr)
        self.host = None
        if pinned:
            hptr = cuda_check(cudart.cudaMallocHost(max(self.nbytes, 1)), "cudaMallocHost")
            weakref.finalize(self, cudart.cudaFreeHost, hptr)
            raw = (ctypes.c_byte * max(self.nbytes, 1)).from_address(hptr)
            self.host = np.frombuffer(raw, dtype=self.dtype, count=int(np.prod(shape))).reshape(shape)


class TensorRTTarget(CacheRows):
    """A decoder-only model run as a TensorRT engine, implementing runtime.backends.base.TargetBackend."""

    name = "tensorrt"

    def __init__(self, spec: ModelSpec, engine_path: str, cache: KVCache, params: Mapping[str, object],
                 tap_names: Sequence[str] = ("final_norm",), bundle_root: str = "BUNDLE", cuda_graphs: bool = False):
        trt, cudart = import_tensorrt(), import_cudart()
        self.trt, self.cudart = trt, cudart
        self.spec, self.cache, self.engine_path = spec, cache, engine_path
        if not os.path.isfile(engine_path):
            raise BackendError(f"{engine_path}: no such engine; build it with "
                               f"`edgespec export --to tensorrt --bundle {bundle_root}`")
        problem = version_mismatch(params, machine_facts(trt, cudart), engine_path, bundle_root)
        if problem:
            raise BackendError(problem)
        if not isinstance(params.get("profiles"), dict) or not params["profiles"]:
            raise BackendError(f"{engine_path}: bundle.yaml records no optimisation profiles for it; rebuild it with "
                               f"`edgespec export --to tensorrt --bundle {bundle_root}`")
        self.profiles = dict(params["profiles"])
        rows = min(int(v["max_positions"]) for v in self.profiles.values())
        if cache.max_positions > rows:
            raise BudgetExceeded(f"{engine_path} was built for {rows} cache rows, the KV arena gives "
                                 f"'{cache.name}' {cache.max_positions}; lower memory.max_context to {rows}, or rebuild them "
                                 f"with `edgespec export --to tensorrt --bundle {bundle_root}` and --max-context "
                                 f"{cache.max_positions}")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        with open(engine_path, "rb") as f:
            self.engine = self.runtime.deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise BackendError(f"{engine_path}: TensorRT could not deserialise the engine (see its log above); "
                               f"rebuild it with `edgespec export --to tensorrt --bundle {bundle_root}`")
        self._check_io(bundle_root)
        self.tap_names = tuple(tap_names)
        for t in self.tap_names:
            parse_tap(t, spec.num_layers)
        self.stream = cuda_check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        self._stream_handle = int(self.stream)
        # One activation buffer for both contexts (they never run at once), as large as the larger profile needs.
        n_prof = self.engine.num_optimization_profiles
        scratch = max(self.engine.get_device_memory_size_for_profile_v2(i) for i in range(n_prof))
        self.scratch = _Buffer(cudart, (max(scratch, 1),), np.uint8)
        self.contexts = []
        for i in range(n_prof):
            ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            ctx.set_device_memory(self.scratch.ptr, scratch)
            ctx.set_optimization_profile_async(i, self._stream_handle)
            self.contexts.append(ctx)
        self.arena = DeviceArena.for_cache(cudart, cache)
        self.k_offset, self.v_offset, _ = cache_offsets(cache.k, cache.v)
        self._row_bytes = spec.num_kv_heads * spec.head_dim * self.kv_dtype.itemsize
        t_max = max(int(v["max_tokens"]) for v in self.profiles.values())
        self.d_ids = _Buffer(cudart, (t_max,), self._dtype("input_ids"))
        self.d_pos = _Buffer(cudart, (t_max,), self._dtype("position_ids"))
        self.d_mask = _Buffer(cudart, (t_max, rows), np.float32)
        self.d_logits = _Buffer(cudart, (t_max, spec.vocab_size), np.float32, pinned=True)
        self.d_taps = {t: _Buffer(cudart, (t_max, spec.hidden_size), np.float32, pinned=True) for t in self.engine_taps}
        self.last_run_s = 0.0
        self.rows = rows
        self.cuda_graphs = cuda_graphs
        self._graphs: Dict[tuple, object] = {}  # (T, padded P) -> cudaGraphExec_t
        if cuda_graphs:
            self.t_graph = int(self.profiles["verify"]["max_tokens"])
            staging = (spec.num_layers, self.t_graph, spec.num_kv_heads, spec.head_dim)
            self.d_new_k, self.d_new_v = _Buffer(cudart, staging, self.kv_dtype), _Buffer(cudart, staging, self.kv_dtype)

    # -- set-up checks --------------------------------------------------------------------------------

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))

    def _check_io(self, bundle_root: str) -> None:
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        layers = sum(1 for n in names if n.startswith("past_key_"))
        rebuild = f"rebuild it with `edgespec export --to tensorrt --bundle {bundle_root}`"
        if layers != self.spec.num_layers or "logits" not in names:
            raise BackendError(f"{self.engine_path}: the engine has {layers} layers' KV inputs, the bundle's spec says "
                               f"{self.spec.num_layers}; {rebuild}")
        self.kv_dtype = self._dtype("past_key_0")
        if self.cache.k.dtype != self.kv_dtype:
            raise BackendError(f"{self.engine_path}: the engine's K/V are {self.kv_dtype}, the KV arena is "
                               f"{self.cache.k.dtype}; {rebuild}")
        if self.engine.num_optimization_profiles != len(self.profiles):
            raise BackendError(f"{self.engine_path}: the engine has {self.engine.num_optimization_profiles} "
                               f"optimisation profiles, bundle.yaml lists {list(self.profiles)}; {rebuild}")
        self.engine_taps = [t for t in ("final_norm", *[f"{k}.{i}" for k in ("layer_in", "layer_out")
                                                         for i in range(self.spec.num_layers)])
                            if tap_output_name(t) in names]

    # -- the TargetBackend interface -----------------------------------------------------------------

    @functools.cached_property  # read once, at load: a re-export next to a running node must not fail requests
    def weight_bytes(self) -> int:
        return os.path.getsize(self.engine_path)

    def _h2d(self, buf: _Buffer, arr: np.ndarray) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_check(self.cudart.cudaMemcpyAsync(buf.ptr, arr.ctypes.data, arr.nbytes, kind, self.stream), "H2D copy")

    def _d2h(self, buf: _Buffer, nbytes: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(self.cudart.cudaMemcpyAsync(buf.host.ctypes.data, buf.ptr, nbytes, kind, self.stream), "D2H copy")

    def forward(self, tokens, positions, mask: Optional[np.ndarray] = None, taps: Sequence[str] = (),
                all_logits: bool = True) -> ForwardResult:
        if not all_logits:  # the last row only (a prefill's): the rest is dropped here, not yet on the device
            res = self.forward(tokens, positions, mask, taps)
            return ForwardResult(logits=res.logits[-1:].copy(), taps=res.taps)
        t, p = len(tokens), self.cache.length
        self.cache.check_room(t)
        for name in taps:
            if name not in self.engine_taps:
                raise BackendError(f"tap {name!r} is not an output of {self.engine_path} (it has {self.engine_taps}); "
                                   "re-export the ONNX graph with --taps, then rebuild the engines")
        prefill_max = int(self.profiles[list(self.profiles)[-1]]["max_tokens"])
        if mask is None and t > prefill_max:
            # a causal forward longer than the prefill profile: consecutive causal chunks of it (exact, base.py)
            return forward_in_chunks(self, tokens, positions, taps, prefill_max)
        if mask is None:
            add_mask = causal_additive_mask(p, t)
        elif mask.shape != (t, p + t):
            raise ValueError(f"mask shape {mask.shape}, expected {(t, p + t)} (new tokens x cache+new)")
        else:
            add_mask = additive_mask(mask)
        index = pick_profile(self.profiles, t, p, self.engine_path)
        # (the padded past must stay inside this cache's own rows: beyond them lie another layer's or model's K/V)
        padded = (graph_bucket(p, t, self.t_graph, min(self.rows, self.cache.max_positions))
                  if self.cuda_graphs and index == 0 else None)
        if padded is not None:
            out = self._forward_graph(tokens, positions, add_mask, p, padded, taps)
            if out is not None:
                return out
        return self._forward_eager(tokens, positions, add_mask, index, taps)

    def _forward_eager(self, tokens, positions, add_mask: np.ndarray, index: int, taps: Sequence[str]) -> ForwardResult:
        """One forward with the past bound in place (P rows) and the new K/V written straight after it."""
        t, p = len(tokens), self.cache.length
        ctx = self.contexts[index]
        self._h2d(self.d_ids, np.ascontiguousarray(tokens, dtype=self.d_ids.dtype))
        self._h2d(self.d_pos, np.ascontiguousarray(positions, dtype=self.d_pos.dtype))
        self._h2d(self.d_mask, np.ascontiguousarray(add_mask))
        ctx.set_input_shape("input_ids", (t,))
        ctx.set_input_shape("position_ids", (t,))
        ctx.set_input_shape("attention_mask", (t, p + t))
        ctx.set_tensor_address("input_ids", self.d_ids.ptr)
        ctx.set_tensor_address("position_ids", self.d_pos.ptr)
        ctx.set_tensor_address("attention_mask", self.d_mask.ptr)
        past = (p, self.spec.num_kv_heads, self.spec.head_dim)
        for name, ptr in kv_addresses(self.arena.ptr, self.k_offset, self.v_offset, self.spec.num_layers,
                                      self.cache.max_positions, self._row_bytes, p).items():
            if name.startswith("past_"):
                ctx.set_input_shape(name, past)
            ctx.set_tensor_address(name, ptr)
        ctx.set_tensor_address("logits", self.d_logits.ptr)
        for name, buf in self.d_taps.items():  # every output needs an address, asked for or not
            ctx.set_tensor_address(tap_output_name(name), buf.ptr)
        start = time.perf_counter()
        if not ctx.execute_async_v3(self._stream_handle):
            raise BackendError(f"{self.engine_path}: execute_async_v3 failed for T={t}, P={p} (see TensorRT's log)")
        self._d2h(self.d_logits, t * self.spec.vocab_size * 4)
        for name in taps:
            self._d2h(self.d_taps[name], t * self.spec.hidden_size * 4)
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self.last_run_s = time.perf_counter() - start
        self.cache.length = p + t
        return ForwardResult(logits=self.d_logits.host[:t].copy(),
                             taps={name: self.d_taps[name].host[:t].copy() for name in taps})

    def _forward_graph(self, tokens, positions, add_mask, p: int, padded: int, taps: Sequence[str]
                       ) -> Optional[ForwardResult]:
        """One verify-profile forward through the CUDA graph of (T, padded P), captured on first use."""
        t = len(tokens)
        self._h2d(self.d_ids, np.ascontiguousarray(tokens, dtype=self.d_ids.dtype))
        self._h2d(self.d_pos, np.ascontiguousarray(positions, dtype=self.d_pos.dtype))
        self._h2d(self.d_mask, padded_mask(add_mask, p, padded))
        start = time.perf_counter()
        graph = self._graphs.get((t, padded))
        if graph is None:
            graph = self._capture(t, padded)
        if graph is None:  # this engine cannot be captured: the caller runs it eagerly, from now on always
            self.cuda_graphs = False
            return None
        cuda_check(self.cudart.cudaGraphLaunch(graph, self.stream), "cudaGraphLaunch")
        kind, block = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.cache.max_positions * self._row_bytes
        for staged, off in ((self.d_new_k, self.k_offset), (self.d_new_v, self.v_offset)):
            cuda_check(self.cudart.cudaMemcpy2DAsync(self.arena.ptr + off + p * self._row_bytes, block, staged.ptr,
                                                     self.t_graph * self._row_bytes, t * self._row_bytes,
                                                     self.spec.num_layers, kind, self.stream), "staged K/V copy")
        self._d2h(self.d_logits, t * self.spec.vocab_size * 4)
        for name in taps:
            self._d2h(self.d_taps[name], t * self.spec.hidden_size * 4)
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self.last_run_s = time.perf_counter() - start
        self.cache.length = p + t
        return ForwardResult(logits=self.d_logits.host[:t].copy(),
                             taps={name: self.d_taps[name].host[:t].copy() for name in taps})

    def _capture(self, t: int, padded: int):
        """Bind the verify context for T tokens over a past of `padded` rows (new K/V to the staging buffers),
        run it once (TensorRT finishes its shape-dependent set-up outside a capture), then capture one
        execute_async_v3 into a CUDA graph. None if the engine cannot be captured."""
        ctx, cudart, row = self.contexts[0], self.cudart, self._row_bytes
        ctx.set_input_shape("input_ids", (t,))
        ctx.set_input_shape("position_ids", (t,))
        ctx.set_input_shape("attention_mask", (t, padded + t))
        for name, addr in (("input_ids", self.d_ids.ptr), ("position_ids", self.d_pos.ptr),
                           ("attention_mask", self.d_mask.ptr), ("logits", self.d_logits.ptr)):
            ctx.set_tensor_address(name, addr)
        for name, buf in self.d_taps.items():
            ctx.set_tensor_address(tap_output_name(name), buf.ptr)
        past = (padded, self.spec.num_kv_heads, self.spec.head_dim)
        addresses = kv_addresses(self.arena.ptr, self.k_offset, self.v_offset, self.spec.num_layers,
                                 self.cache.max_positions, row, 0)
        for i in range(self.spec.num_layers):
            for kind, staged in (("key", self.d_new_k), ("value", self.d_new_v)):
                ctx.set_input_shape(f"past_{kind}_{i}", past)
                ctx.set_tensor_address(f"past_{kind}_{i}", addresses[f"past_{kind}_{i}"])
                ctx.set_tensor_address(f"new_{kind}_{i}", staged.ptr + i * self.t_graph * row)
        if not ctx.execute_async_v3(self._stream_handle):
            return None
        cuda_check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        cuda_check(cudart.cudaStreamBeginCapture(self.stream, mode), "cudaStreamBeginCapture")
        ok = ctx.execute_async_v3(self._stream_handle)
        err, graph = cudart.cudaStreamEndCapture(self.stream)
        if not ok or int(err) != 0:  # TensorRT refused, or the capture was invalidated: drop it, clear the error
            if int(err) == 0 and graph is not None:
                cudart.cudaGraphDestroy(graph)
            cudart.cudaGetLastError()
            return None
        exe = cuda_check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        cudart.cudaGraphDestroy(graph)
        weakref.finalize(self, cudart.cudaGraphExecDestroy, exe)
        self._graphs[(t, padded)] = exe
        return exe

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """KVCache.keep's contract on the device buffer: each run of accepted rows moves once, all layers in one
        2-D copy (rows of `row_bytes`, one per layer, layers `max_positions` rows apart)."""
        rows = list(rows)
        length = self.cache.length
        if start > length or any(r < start or r >= length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {length} valid rows of '{self.cache.name}'")
        block, kind = self.cache.max_positions * self._row_bytes, self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for src, dst, n in row_moves(start, rows):
            for off in (self.k_offset, self.v_offset):
                base = self.arena.ptr + off
                cuda_check(self.cudart.cudaMemcpy2DAsync(base + dst * self._row_bytes, block, base + src * self._row_bytes,
                                                         block, n * self._row_bytes, self.spec.num_layers, kind,
                                                         self.stream), "cudaMemcpy2DAsync (keep)")
        cuda_check(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        self.cache.length = start + len(rows)

    def layer_kv(self, layer: int):
        """(K, V) rows [0, cache_len) of one layer copied to the host, each (cache_len, nkv, d): for checks."""
        n, out = self.cache.length, []
        for off in (self.k_offset, self.v_offset):
            host = np.empty((n, self.spec.num_kv_heads, self.spec.head_dim), self.kv_dtype)
            src = self.arena.ptr + off + layer * self.cache.max_positions * self._row_bytes
            cuda_check(self.cudart.cudaMemcpy(host.ctypes.data, src, host.nbytes,
                                              self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "D2H copy")
            out.append(host)
        return out[0], out[1]

