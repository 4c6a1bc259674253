"""The ONNX Runtime target backend: runs the graph `edgespec export --to onnx` writes, on CPU here and
through the CUDA / TensorRT execution providers on a Jetson.

Zero-copy KV. The graph takes each layer's past K/V (P, nkv, d) and returns only the new rows (T, nkv, d).
This backend keeps its cache LAYER-major: the bytes of its `KVCache` (a view of the process's one arena)
are read as (L, max_pos, nkv, d), so layer i's past `k[i, :P]` is one contiguous block, bound as input
`past_key_{i}` by pointer, and output `new_key_{i}` is bound to `k[i, P:P+T]`, so ORT writes the new rows
straight into the arena. Nothing of size O(context) is copied per step, in Python or in the graph (a
single position-major (P, L, nkv, d) input would make the graph split the past into layers: a full copy
of the cache every step, measured at ~25% of a 125M model's step at context 2048). Rolling back is a
smaller P; after a tree verify `keep` moves only the accepted rows.

A graph exported with `--attention gqa` (ONNX Runtime's GroupQueryAttention, export/onnx/gqa.py) has outputs
present_key_{i} instead of new_key_{i}: the op takes one shared past/present buffer per layer in BNSH form, so
this backend then reads its arena HEAD-major, (L, nkv, max_pos, d), binds layer i's whole block
(1, nkv, max_pos, d) as both past_key_i and present_key_i, and the op writes rows [P, P+T) in place. The fused
graph (`--attention fused`, the default for fp32 targets: export/onnx/fused.py) has the same contract.

Logits and taps are written into preallocated host arrays the same way. With the CUDA or TensorRT provider
first in the list, the K/V live in device memory instead (runtime/backends/onnx_arena.py: an OrtValue arena,
bound by device address, rows moved on the device); then only ids, positions, mask in and logits/taps out
cross the bus."""
from __future__ import annotations

import functools

import os
import time
from typing import Dict, Optional, Sequence

import numpy as np

from runtime.backends.base import CacheRows, ForwardResult, parse_tap
from runtime.backends.onnx_arena import OrtKVArena, device_for
from runtime.backends.onnx_net import bundle_of, import_ort, open_session
from runtime.errors import BackendError
from runtime.memory.kv import KVCache
from runtime.model.spec import ModelSpec

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def tap_output_name(tap: str) -> str:
    """'layer_in.3' -> 'tap_layer_in_3' (the graph's output name for a hidden tap)."""
    return "tap_" + tap.replace(".", "_")


def additive_mask(mask: np.ndarray) -> np.ndarray:
    """(T, S) bool, True = may attend -> (T, S) float32 with 0 / -inf, the graph's attention_mask."""
    return np.where(mask, np.float32(0.0), np.float32(-np.inf))


def causal_additive_mask(cache_len: int, t: int) -> np.ndarray:
    """The additive form of runtime.model.layers.causal_mask, built without an intermediate bool array."""
    m = np.zeros((t, cache_len + t), np.float32)
    if t > 1:
        m[:, cache_len:][np.triu_indices(t, 1)] = -np.inf
    return m


def _binders(ort, binding, device: str = "cpu", device_id: int = 0):
    """bind_input / bind_output(name, dtype, shape, ptr) for memory on `device`. The public IOBinding methods
    rebuild an OrtDevice on every call (~half of this backend's Python time per step with 4 binds per
    layer); where the wrapped C binding is reachable, bind through it with the device built once."""
    c_binding = getattr(binding, "_iobinding", None)
    try:
        c_device = ort.OrtDevice.make(device, device_id)._get_c_device()
    except AttributeError:
        c_binding = None
    if c_binding is None:
        return (lambda n, dt, shape, ptr: binding.bind_input(n, device, device_id, dt, shape, ptr),
                lambda n, dt, shape, ptr: binding.bind_output(n, device, device_id, dt, shape, ptr))
    return (lambda n, dt, shape, ptr: c_binding.bind_input(n, c_device, dt, shape, ptr),
            lambda n, dt, shape, ptr: c_binding.bind_output(n, c_device, dt, shape, ptr))


class OnnxTarget(CacheRows):
    """A decoder-only model run by ONNX Runtime, implementing runtime.backends.base.TargetBackend."""

    name = "onnx"

    def __init__(self, spec: ModelSpec, model_path: str, cache: KVCache,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 0,
                 tap_names: Sequence[str] = ("final_norm",), profile_prefix: str = "",
                 arena_device: Optional[str] = None, spinning: str = "never"):
        ort = import_ort()
        self.spec = spec
        self.cache = cache
        self.model_path = model_path
        self.session = open_session(model_path, providers, threads, profile_prefix, spinning)
        self.threads = threads or os.cpu_count() or 1
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "past_key_0" not in inputs:
            raise BackendError(f"{model_path}: the graph has no per-layer inputs past_key_i (an older export?); "
                               f"re-export it with `edgespec export --to onnx --bundle {bundle_of(model_path)}`")
        graph_layers = sum(1 for n in inputs if n.startswith("past_key_"))
        if graph_layers != spec.num_layers:
            raise BackendError(f"{model_path}: the graph has {graph_layers} layers, the bundle's spec says "
                               f"{spec.num_layers}; re-export it with "
                               f"`edgespec export --to onnx --bundle {bundle_of(model_path)}`")
        self.kv_dtype = np.dtype(_ORT_DTYPES[inputs["past_key_0"].type])
        if cache.k.dtype != self.kv_dtype:
            raise BackendError(f"{model_path}: the graph's K/V are {self.kv_dtype}, the KV arena is {cache.k.dtype}; "
                               "allocate the arena with the graph's dtype (fp16 graph -> float16 arena)")
        outputs = {o.name for o in self.session.get_outputs()}
        # GroupQueryAttention graphs: one shared past/present buffer per layer, head-major (module docstring)
        self.shared_kv = "present_key_0" in outputs
        if self.shared_kv and device_for(providers) == "cuda":  # ONNX Runtime 1.32's CUDA kernel, per its source
            raise BackendError(f"{model_path}: this graph's GroupQueryAttention takes the tree mask as attention_bias, "
                               f"which ONNX Runtime's CUDA kernel refuses; re-export it for the GPU with `edgespec "
                               f"export --to onnx --bundle {bundle_of(model_path)} --attention matmul`")
        # fused graphs: logits for rows [logits_from, T) only (export/onnx/fused.py); 0 = all, T-1 = a prefill's last
        self._logits_from = np.zeros(1, np.int64) if "logits_from" in inputs else None
        meta = self.session.get_modelmeta().custom_metadata_map
        # fused graphs: the attention op is causal itself, so a causal forward binds an all-zero bias (_zero_bias)
        self._causal_op = meta.get("attention_is_causal") == "1"
        self._zeros = np.zeros(0, np.float32)
        # ids and positions of a forward, (2, >= T) int64, kept across forwards: bound again only when T or the
        # buffer changes (a plain step writes two numbers instead of making two bindings); None = not bound.
        self._io = np.zeros((2, 64), np.int64)
        self._io_bound: Optional[int] = None
        rope = meta.get("rope_positions")
        if rope is not None and cache.max_positions > int(rope):  # a fused graph's rope table (export/onnx/fused.py)
            raise BackendError(f"{model_path}: the graph's rope table holds {rope} positions, the KV cache "
                               f"{cache.max_positions}; lower memory.max_context to {rope} or less")
        self.tap_names = tuple(tap_names)
        for t in self.tap_names:
            parse_tap(t, spec.num_layers)
            if tap_output_name(t) not in outputs:
                raise BackendError(f"{model_path}: the graph has no output for tap {t!r}; re-export with --taps {t}")
        # A fused graph's taps are its layers' (1, T, H) tensors themselves (export/onnx/fused.py), others' (T, H):
        # the same bytes, bound with the graph's own rank.
        ranks = {len(o.shape) for o in self.session.get_outputs() if o.name.startswith("tap_")}
        self._tap_lead = (1,) if ranks == {3} else ()
        self.binding = self.session.io_binding()
        self._bind_input, self._bind_output = _binders(ort, self.binding)
        n, heads, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self._row = (heads, d)
        self._row_bytes = heads * d * self.kv_dtype.itemsize
        # Where the K/V live: the host arena (CPU provider, a Jetson's unified memory) or, with a CUDA /
        # TensorRT provider first, an OrtValue on that device (runtime/backends/onnx_arena.py); "cpu" here
        # runs that device path on the CPU provider (tests).
        self.device = device_for(providers) if arena_device is None else arena_device
        self.device_arena: Optional[OrtKVArena] = None
        if self.device != "cpu" or arena_device is not None:
            # Head-major, the device arena's "layers" are the L*nkv (layer, head) blocks of (max_pos, d) rows.
            units, unit_heads = (n * heads, 1) if self.shared_kv else (n, heads)
            self.device_arena = OrtKVArena(ort, units, cache.max_positions, unit_heads, d, self.kv_dtype, self.device,
                                           providers=providers)
            self._bind_kv_in, self._bind_kv_out = _binders(ort, self.binding, self.device)
            self._ptrs = [(f"_{i}", *self.device_arena.addresses(i * units // n, 0)[:2]) for i in range(n)]
        else:
            # The same host arena bytes, seen layer-major (see the module docstring), head-major for GQA graphs.
            view = (n, heads, cache.max_positions, d) if self.shared_kv else (n, cache.max_positions, heads, d)
            self.k = cache.k.reshape(view)  # (L, max_pos, nkv, d) or (L, nkv, max_pos, d)
            self.v = cache.v.reshape(view)
            self._bind_kv_in, self._bind_kv_out = self._bind_input, self._bind_output
            self._ptrs = [(f"_{i}", self.k[i].ctypes.data, self.v[i].ctypes.data) for i in range(n)]
        self._kv_bound: Optional[tuple] = None  # the taps bound with the shared K/V blocks (_bind_shared_kv)
        # One-row steps (plain decoding, a cycle that drafts nothing) with shared K/V: logits and taps land in kept
        # (1, .) buffers bound once (the taps they were bound for: _one_bound) and leave as copies.
        self._one_bound: Optional[tuple] = None
        self._one: Dict[str, np.ndarray] = {}
        self.last_run_s = 0.0  # time inside ORT during the last forward (the rest is Python overhead)

    @functools.cached_property  # read once, at load: a re-export next to a running node must not fail requests
    def weight_bytes(self) -> int:
        """Bytes of the graph and its external data: what one decode step streams from memory."""
        data = self.model_path + ".data"
        return os.path.getsize(self.model_path) + (os.path.getsize(data) if os.path.isfile(data) else 0)

    def _bind_in(self, name: str, arr: np.ndarray) -> None:
        self._bind_input(name, arr.dtype, arr.shape, arr.ctypes.data)

    def _bind_out(self, name: str, arr: np.ndarray) -> None:
        self._bind_output(name, arr.dtype, arr.shape, arr.ctypes.data)

    def forward(self, tokens, positions, mask: Optional[np.ndarray] = None, taps: Sequence[str] = (),
                all_logits: bool = True) -> ForwardResult:
        tokens, positions = np.asarray(tokens), np.asarray(positions)
        t, p = tokens.shape[0], self.cache.length
        if positions.shape != (t,):
            raise ValueError(f"positions shape {positions.shape}, expected ({t},) (one per token)")
        self.cache.check_room(t)
        for name in taps:
            if name not in self.tap_names:
                raise BackendError(f"tap {name!r} was not exported in {self.model_path} (it has {list(self.tap_names)}); "
                                   f"re-export with `edgespec export --to onnx --bundle {bundle_of(self.model_path)} "
                                   f"--taps {' '.join(sorted(set(self.tap_names) | {name}))}`")
        if mask is None:
            add_mask = self._zero_bias(t, p) if self._causal_op else causal_additive_mask(p, t)
        else:
            if mask.shape != (t, p + t):
                raise ValueError(f"mask shape {mask.shape}, expected {(t, p + t)} (new tokens x cache+new)")
            add_mask = additive_mask(mask)
        rows = t if all_logits or self._logits_from is None else 1
        b = self.binding
        if self.shared_kv:
            self._bind_shared_kv(tuple(taps))
            if t == 1:
                return self._one_row(tokens, positions, add_mask, tuple(taps))
        logits = np.empty((rows, self.spec.vocab_size), np.float32)
        got: Dict[str, np.ndarray] = {name: np.empty((t, self.spec.hidden_size), np.float32) for name in taps}
        self._one_bound = None  # the outputs bound below replace the one-row buffers' bindings
        if not self.shared_kv:
            b.clear_binding_inputs()
            b.clear_binding_outputs()
            self._io_bound = None
            past, new, dt = (p, *self._row), (t, *self._row), self.kv_dtype
            skip = p * self._row_bytes
            for i, kp, vp in self._ptrs:
                # Layer i's past is rows [0, P) of its block and the new rows land at [P, P+T): by pointer, no copy.
                self._bind_kv_in("past_key" + i, dt, past, kp)
                self._bind_kv_in("past_value" + i, dt, past, vp)
                self._bind_kv_out("new_key" + i, dt, new, kp + skip)
                self._bind_kv_out("new_value" + i, dt, new, vp + skip)
        # binding a name again replaces its earlier binding
        self._step_inputs(tokens, positions)
        self._bind_in("attention_mask", add_mask)  # (T, P+T): its shape changes every step
        if self._logits_from is not None:
            self._logits_from[0] = t - rows  # bound by pointer (_step_inputs): read when the graph runs
        self._bind_out("logits", logits)
        for name, arr in got.items():
            self._bind_output(tap_output_name(name), arr.dtype, self._tap_lead + arr.shape, arr.ctypes.data)
        start = time.perf_counter()
        self.session.run_with_iobinding(b)
        self.last_run_s = time.perf_counter() - start
        self.cache.length = p + t
        return ForwardResult(logits=logits if all_logits or rows == 1 else logits[-1:].copy(), taps=got)

    def _one_row(self, tokens: np.ndarray, positions: np.ndarray, add_mask: np.ndarray, taps: tuple) -> ForwardResult:
        """forward of one row on shared K/V blocks: the outputs' bindings are made once per set of taps, so a step
        binds only its ids, positions and mask; the caller gets copies (1 x V logits, 1 x H per tap)."""
        if self._one_bound != taps:
            self._one = {"logits": np.empty((1, self.spec.vocab_size), np.float32),
                         **{name: np.empty((1, self.spec.hidden_size), np.float32) for name in taps}}
            self._bind_out("logits", self._one["logits"])
            for name in taps:
                arr = self._one[name]
                self._bind_output(tap_output_name(name), arr.dtype, self._tap_lead + arr.shape, arr.ctypes.data)
            self._one_bound = taps
        self._step_inputs(tokens, positions)
        self._bind_in("attention_mask", add_mask)
        if self._logits_from is not None:
            self._logits_from[0] = 0
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        self.last_run_s = time.perf_counter() - start
        self.cache.length += 1
        return ForwardResult(logits=self._one["logits"].copy(), taps={name: self._one[name].copy() for name in taps})

    def _step_inputs(self, tokens: np.ndarray, positions: np.ndarray) -> None:
        """Write ids and positions into the kept (2, >= T) buffer; bind its rows (and logits_from) only when T or the
        buffer changed since they were last bound: ORT reads bound memory when the graph runs."""
        t = tokens.shape[0]
        if self._io.shape[1] < t:
            self._io = np.zeros((2, max(t, 2 * self._io.shape[1])), np.int64)
            self._io_bound = None
        self._io[0, :t] = tokens
        self._io[1, :t] = positions
        if self._io_bound != t:
            self._bind_in("input_ids", self._io[0, :t])
            self._bind_in("position_ids", self._io[1, :t])
            if self._logits_from is not None:
                self._bind_in("logits_from", self._logits_from)
            self._io_bound = t

    def _zero_bias(self, t: int, p: int) -> np.ndarray:
        """(T, P+T) zeros, a view of one buffer kept across steps (grown, never refilled: nothing writes it)."""
        n = t * (p + t)
        if self._zeros.size < n:
            self._zeros = np.zeros(max(n, 2 * self._zeros.size), np.float32)
        return self._zeros[:n].reshape(t, p + t)

    def _bind_shared_kv(self, taps: tuple) -> None:
        """GroupQueryAttention graphs: the op reads rows [0, P) and writes [P, P+T) of each layer's whole block,
        bound as both past and present, so the 4 bindings per layer are the same every step: made once, and again
        only when the set of bound outputs changes (a tap bound earlier with another T would not match)."""
        if self._kv_bound == taps:
            return
        b, dt = self.binding, self.kv_dtype
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        self._io_bound = self._one_bound = None
        block = (1, self._row[0], self.cache.max_positions, self._row[1])
        for i, kp, vp in self._ptrs:
            self._bind_kv_in("past_key" + i, dt, block, kp)
            self._bind_kv_in("past_value" + i, dt, block, vp)
            self._bind_kv_out("present_key" + i, dt, block, kp)
            self._bind_kv_out("present_value" + i, dt, block, vp)
        self._kv_bound = taps

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """KVCache.keep's contract, on the layer-major view: only the accepted rows move, once."""
        rows = list(rows)
        length = self.cache.length
        if start > length or any(r < start or r >= length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {length} valid rows of '{self.cache.name}'")
        n = len(rows)
        if self.device_arena is not None:
            self.device_arena.keep(start, rows)
        elif n and rows != list(range(start, start + n)):
            idx = np.asarray(rows)
            if self.shared_kv:
                self.k[:, :, start:start + n] = self.k[:, :, idx]
                self.v[:, :, start:start + n] = self.v[:, :, idx]
            else:
                self.k[:, start:start + n] = self.k[:, idx]
                self.v[:, start:start + n] = self.v[:, idx]
        self.cache.length = start + n

    def layer_kv(self, layer: int):
        """(K, V) rows [0, cache_len) of one layer, each (cache_len, nkv, d): views of the host arena (copies
        from a device arena), for tests and tools."""
        length, heads = self.cache.length, self._row[0]
        if self.device_arena is not None and self.shared_kv:
            blocks = [self.device_arena.layer_kv(layer * heads + h, length) for h in range(heads)]
            return tuple(np.concatenate([b[j] for b in blocks], axis=1) for j in (0, 1))
        if self.device_arena is not None:
            return self.device_arena.layer_kv(layer, length)
        if self.shared_kv:
            return self.k[layer, :, :length].transpose(1, 0, 2), self.v[layer, :, :length].transpose(1, 0, 2)
        return self.k[layer, :length], self.v[layer, :length]

