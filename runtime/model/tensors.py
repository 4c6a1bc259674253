"""Read and write safetensors files with numpy only (the robot needs no torch and no `safetensors`).

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw bytes.
bf16 has no numpy dtype: it is widened to float32 on read (its bits are the top half of a float32), and
written back as BF16 when asked (`bf16=`), so a bf16 checkpoint keeps its size in a bundle."""
from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from runtime.errors import BundleError

_DTYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _header(path: str):
    """(header length, header) of a .safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise BundleError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise BundleError(f"{path}: cannot read safetensors ({exc}); re-export the file") from exc
    if not isinstance(header, dict):
        raise BundleError(f"{path}: not a safetensors file (header is not a mapping)")
    return n, header


def safetensors_dtypes(path: str) -> Dict[str, str]:
    """{tensor name: dtype as stored ("BF16", "F16", "F32", ...)}, read from the header alone."""
    _, header = _header(path)
    return {name: info["dtype"] for name, info in header.items() if name != "__metadata__"}


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """All tensors of a .safetensors file as numpy arrays (bf16 -> float32), memory-mapped where possible."""
    n, header = _header(path)
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


def to_bf16_bits(name: str, arr: np.ndarray) -> np.ndarray:
    """float32 values that came from bf16 (low 16 bits zero) -> their (…,) uint16 bf16 bits, losslessly.
    Example: 1.5 (0x3FC00000) -> 0x3FC0. Any other float32 would be rounded, so it is refused."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    if (bits & 0xFFFF).any():
        raise ValueError(f"tensor {name}: float32 values that are not exact bf16 cannot be stored as bf16 unrounded")
    return (bits >> 16).astype(np.uint16)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: Optional[Dict[str, str]] = None,
                      bf16: Sequence[str] = ()) -> None:
    """Write numpy arrays as a safetensors file (keys sorted, data 8-byte aligned as the spec asks).
    Tensors named in `bf16` (float32 read from bf16) are stored as BF16 again, bit for bit."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    narrow = set(bf16)
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if name in narrow:
            arr, dtype = to_bf16_bits(name, arr), "BF16"
        elif arr.dtype in _NAMES:
            dtype = _NAMES[arr.dtype]
        else:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    # Written beside `path` and renamed over it: a reader never sees half a file, and a hard link to an older
    # file at `path` (a bundle edited through a hard-linked copy, export/bundle/edit.py) keeps the old bytes.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for arr in arrays:
                f.write(arr.tobytes())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would differ from the bundle's other files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
