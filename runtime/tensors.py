"""Read and write safetensors files with numpy only (the robot needs no torch and no `safetensors`).

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw bytes.
bf16 has no numpy dtype: it is widened to float32 on read (its bits are the top half of a float32)."""
from __future__ import annotations

import json
import struct
from typing import Dict, Mapping, Optional

import numpy as np

from runtime.errors import BundleError

_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bf16 -> float32), memory-mapped where possible."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise BundleError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise BundleError(f"{path}: cannot read safetensors ({exc}); re-export the file") from exc
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    if ends and max(ends) > raw.shape[0]:
        raise BundleError(f"{path}: truncated ({raw.shape[0]} data bytes, header needs {max(ends)}); copy it again")
    out: Dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = raw[start:end]
        shape = tuple(info["shape"])
        if info["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(shape)
        elif info["dtype"] in _DTYPES:
            out[name] = np.frombuffer(buf, dtype=_DTYPES[info["dtype"]]).reshape(shape)
        else:
            raise BundleError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
    return out


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> None:
    """Write numpy arrays as a safetensors file (keys sorted, data 8-byte aligned as the spec asks)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
