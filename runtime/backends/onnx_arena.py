"""The target's KV arena as ONNX Runtime device memory (an OrtValue), for the CUDA / TensorRT providers.

On a GPU the arena lives where the graph runs: one OrtValue per K and V of shape (L, max_pos, nkv, d)
(layer-major, as runtime/backends/onnx.py reads its host arena), allocated with
`OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)`. OnnxTarget binds layer i's past as rows
[0, P) of its block and the new rows as [P, P+T) BY DEVICE ADDRESS (`data_ptr()` + offset), exactly as it
binds host pointers, so no K/V crosses the bus per step; only the token ids, positions and mask go in and
the logits (and taps) come back, one small copy each.

After a tree verify, `keep` moves the accepted rows on the device with a two-node Gather graph
(KV_ROWS_GRAPH): all layers' accepted rows into a scratch OrtValue in one run, then each layer's back to
rows [start, start+n) (a separate buffer, because a parallel in-place gather would race when a row moves
onto a row another thread still reads). A chain's accepted rows are already in place: nothing runs.

The same class runs on the CPU provider with device "cpu" (tests exercise every line of it here);
`device_for(providers)` picks "cuda" where the first provider is CUDA or TensorRT.

`python -m runtime.commands.gpu_identity` checks greedy identity with the arena on a device
(scripts/gpu_check.sh calls it)."""
from __future__ import annotations

import base64
from typing import Sequence

import numpy as np

from runtime.errors import BackendError

# Providers whose graphs run on a CUDA device: the arena is allocated there.
DEVICE_PROVIDERS = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}

# Inputs k, v (A, S, W) and idx int64 (N,); outputs k_rows, v_rows = Gather(k|v, idx, axis=1) (A, N, W).
# Serialized by onnx.helper (opset 13, IR 8); tests/runtime/backends/test_onnx_device_arena.py rebuilds it and compares bytes.
KV_ROWS_GRAPH = {
    np.dtype(np.float32): base64.b64decode(
        "CAgSCGVkZ2VzcGVjOuUBCiUKAWsKA2lkeBIGa19yb3dzIgZHYXRoZXIqCwoEYXhpcxgBoAECCiUKAXYKA2lkeBIGdl9yb3dzIgZHYXRo"
        "ZXIqCwoEYXhpcxgBoAECEgdrdl9yb3dzWhoKAWsSFQoTCAESDwoDEgFBCgMSAVMKAxIBV1oaCgF2EhUKEwgBEg8KAxIBQQoDEgFTCgMS"
        "AVdaEgoDaWR4EgsKCQgHEgUKAxIBTmIfCgZrX3Jvd3MSFQoTCAESDwoDEgFBCgMSAU4KAxIBV2IfCgZ2X3Jvd3MSFQoTCAESDwoDEgFB"
        "CgMSAU4KAxIBV0IECgAQDQ=="),
    np.dtype(np.float16): base64.b64decode(
        "CAgSCGVkZ2VzcGVjOuUBCiUKAWsKA2lkeBIGa19yb3dzIgZHYXRoZXIqCwoEYXhpcxgBoAECCiUKAXYKA2lkeBIGdl9yb3dzIgZHYXRo"
        "ZXIqCwoEYXhpcxgBoAECEgdrdl9yb3dzWhoKAWsSFQoTCAoSDwoDEgFBCgMSAVMKAxIBV1oaCgF2EhUKEwgKEg8KAxIBQQoDEgFTCgMS"
        "AVdaEgoDaWR4EgsKCQgHEgUKAxIBTmIfCgZrX3Jvd3MSFQoTCAoSDwoDEgFBCgMSAU4KAxIBV2IfCgZ2X3Jvd3MSFQoTCAoSDwoDEgFB"
        "CgMSAU4KAxIBV0IECgAQDQ=="),
}


def device_for(providers: Sequence[str]) -> str:
    """Where the arena belongs: "cuda" when the first provider runs on a CUDA device, else "cpu".

    >>> device_for(["TensorrtExecutionProvider", "CUDAExecutionProvider"]), device_for(["CPUExecutionProvider"])
    ('cuda', 'cpu')"""
    return DEVICE_PROVIDERS.get(providers[0], "cpu") if providers else "cpu"


def row_addresses(base: int, layer: int, max_positions: int, row_bytes: int, past: int) -> tuple:
    """(address of layer `layer`'s row 0, address of its row `past`) in a layer-major (L, max_pos, row) buffer
    at `base`: where the past is bound and where the new rows are written.

    >>> row_addresses(1000, 2, 10, 4, 3)  # layer 2 starts 2 * 10 rows of 4 bytes in; row 3 is 12 bytes further
    (1080, 1092)"""
    start = base + layer * max_positions * row_bytes
    return start, start + past * row_bytes


def moves(start: int, rows: Sequence[int]) -> bool:
    """Whether keep(start, rows) has to move anything: not when the rows are already start, start+1, ...

    >>> moves(5, [5, 6, 7]), moves(5, [5, 7])
    (False, True)"""
    return list(rows) != list(range(start, start + len(rows)))


class OrtKVArena:
    """K and V of one model as two OrtValues (L, max_pos, nkv, d) on `device` ("cuda" or "cpu")."""

    def __init__(self, ort, num_layers: int, max_positions: int, num_kv_heads: int, head_dim: int, dtype,
                 device: str = "cuda", device_id: int = 0, providers: Sequence[str] = ("CPUExecutionProvider",)):
        self.dtype = np.dtype(dtype)
        if self.dtype not in KV_ROWS_GRAPH:
            raise BackendError(f"a device KV arena holds float32 or float16, not {self.dtype}")
        self.device, self.device_id = device, device_id
        self.num_layers, self.max_positions = num_layers, max_positions
        self.width = num_kv_heads * head_dim
        self.row_bytes = self.width * self.dtype.itemsize
        shape = (num_layers, max_positions, num_kv_heads, head_dim)
        try:
            self.k = ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, device, device_id)
            self.v = ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, device, device_id)
        except Exception as exc:  # ORT raises its own types when the device or its memory is missing
            raise BackendError(f"could not allocate the KV arena ({2 * np.prod(shape) * self.dtype.itemsize / 2**20:.0f} "
                               f"MiB) on {device}:{device_id} ({exc}); lower memory.max_context or use the CPU "
                               "provider") from exc
        self._ort = ort
        self._scratch_rows = 0  # the accepted rows of every layer, between the two gather runs of keep()
        self._rows = ort.InferenceSession(KV_ROWS_GRAPH[self.dtype], providers=list(providers))
        self._binding = self._rows.io_binding()
        self.k_ptr, self.v_ptr = self.k.data_ptr(), self.v.data_ptr()

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * (self.max_positions + self._scratch_rows) * self.row_bytes

    def _scratch(self, n: int) -> tuple:
        """Device addresses of scratch K and V (L, >= n, W), grown on demand (a tree's accepted path is short)."""
        if n > self._scratch_rows:
            self._scratch_rows = max(n, 64)
            shape = (self.num_layers, self._scratch_rows, self.width)
            make = self._ort.OrtValue.ortvalue_from_shape_and_type
            self._scratch_k = make(shape, self.dtype, self.device, self.device_id)
            self._scratch_v = make(shape, self.dtype, self.device, self.device_id)
        return self._scratch_k.data_ptr(), self._scratch_v.data_ptr()

    def addresses(self, layer: int, past: int) -> tuple:
        """(k past, v past, k new, v new) device addresses of layer `layer` with `past` rows held."""
        k0, kn = row_addresses(self.k_ptr, layer, self.max_positions, self.row_bytes, past)
        v0, vn = row_addresses(self.v_ptr, layer, self.max_positions, self.row_bytes, past)
        return k0, v0, kn, vn

    def _gather(self, k_ptr: int, v_ptr: int, shape: tuple, idx: np.ndarray, k_out: int, v_out: int) -> None:
        b, dt, dev, i = self._binding, self.dtype, self.device, self.device_id
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        b.bind_input("k", dev, i, dt, list(shape), k_ptr)
        b.bind_input("v", dev, i, dt, list(shape), v_ptr)
        b.bind_cpu_input("idx", idx)
        out = [shape[0], len(idx), shape[2]]
        b.bind_output("k_rows", dev, i, dt, out, k_out)
        b.bind_output("v_rows", dev, i, dt, out, v_out)
        self._rows.run_with_iobinding(b)

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Move rows `rows` (ascending, each >= start) of every layer to start, start+1, ... on the device."""
        rows = list(rows)
        if not moves(start, rows):
            return
        n = len(rows)
        sk, sv = self._scratch(n)
        # 1) every layer's accepted rows -> scratch (L, n, W), in one run over the whole arena
        self._gather(self.k_ptr, self.v_ptr, (self.num_layers, self.max_positions, self.width),
                     np.asarray(rows, np.int64), sk, sv)
        # 2) scratch layer i -> arena layer i rows [start, start+n)
        ident = np.arange(n, dtype=np.int64)
        for layer in range(self.num_layers):
            _, _, kn, vn = self.addresses(layer, start)
            off = layer * n * self.row_bytes
            self._gather(sk + off, sv + off, (1, n, self.width), ident, kn, vn)

    def layer_kv(self, layer: int, length: int):
        """(K, V) rows [0, length) of one layer as host arrays (length, nkv, d): a copy, for tests and tools."""
        k, v = self.k.numpy(), self.v.numpy()
        return k[layer, :length].copy(), v[layer, :length].copy()
