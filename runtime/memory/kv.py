"""One KV arena per process, shared by the target and the drafter.

The arena is a single preallocated buffer sized from the memory budget; each model gets a `KVCache`
carved out of it. A cache is position-major, shape (max_positions, layers, kv_heads, head_dim) for K
and for V, so the first P rows `k[:P]` are one contiguous block: a backend binds the past without a
copy and writes the new K/V straight into rows P..P+T. Rolling back is free (a smaller length);
after a tree verify only the accepted rows are moved, once, to be contiguous."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence

import numpy as np

from runtime.errors import BudgetExceeded


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def floats_per_position(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim


class KVCache:
    """K and V rows of one model, a view into the arena. Rows [0, length) are valid."""

    def __init__(self, name: str, shape: CacheShape, k: np.ndarray, v: np.ndarray):
        self.name = name
        self.shape = shape
        self.k = k  # (max_positions, layers, kv_heads, head_dim)
        self.v = v
        self.length = 0

    @property
    def max_positions(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, new_rows: int) -> None:
        if self.length + new_rows > self.max_positions:
            raise BudgetExceeded(
                f"KV cache '{self.name}' holds {self.max_positions} positions; {self.length} used, "
                f"{new_rows} more asked. Raise the memory budget / max_context or shorten the request."
            )

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep rows [0, start), then `rows` (ascending absolute indices >= start) moved to start.."""
        rows = list(rows)
        if start > self.length or any(r < start or r >= self.length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {self.length} valid rows of '{self.name}'")
        n = len(rows)
        if n and rows != list(range(start, start + n)):
            # Only the accepted path moves; rows are ascending so a forward copy never overwrites a source.
            idx = np.asarray(rows)
            self.k[start:start + n] = self.k[idx]
            self.v[start:start + n] = self.v[idx]
        self.length = start + n

    def reset(self) -> None:
        self.length = 0


class KVArena:
    """The process's single KV buffer. `allocate` hands out caches until the buffer is full."""

    def __init__(self, capacity_bytes: int, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        try:
            self._buf = np.zeros(int(capacity_bytes) // self.dtype.itemsize, dtype=self.dtype)
        except MemoryError:  # numpy's _ArrayMemoryError: say what was asked and what to change
            raise BudgetExceeded(f"KV arena: cannot allocate {capacity_bytes / 2**30:.1f} GiB on this machine; "
                                 "lower max_context (--max-context) or set memory.budget_mb") from None
        self._used = 0
        self.caches: Dict[str, KVCache] = {}

    @property
    def capacity_bytes(self) -> int:
        return self._buf.nbytes

    @property
    def used_bytes(self) -> int:
        return self._used * self.dtype.itemsize

    def allocate(self, name: str, shape: CacheShape, max_positions: int) -> KVCache:
        n = max_positions * shape.floats_per_position
        if self._used + 2 * n > self._buf.size:
            raise BudgetExceeded(
                f"KV arena: cache '{name}' needs {2 * n * self.dtype.itemsize / 2**20:.1f} MiB for {max_positions} "
                f"positions, {(self._buf.size - self._used) * self.dtype.itemsize / 2**20:.1f} MiB left of "
                f"{self.capacity_bytes / 2**20:.1f} MiB. Lower max_context or raise the KV budget."
            )
        view = (max_positions, shape.num_layers, shape.num_kv_heads, shape.head_dim)
        k = self._buf[self._used:self._used + n].reshape(view)
        v = self._buf[self._used + n:self._used + 2 * n].reshape(view)
        self._used += 2 * n
        cache = KVCache(name, shape, k, v)
        self.caches[name] = cache
        return cache

    @staticmethod
    def for_context(shapes: Dict[str, CacheShape], max_positions: int, dtype=np.float32) -> "KVArena":
        """An arena exactly big enough for every named model to hold `max_positions` rows."""
        per_pos = sum(s.floats_per_position for s in shapes.values())
        return KVArena(2 * per_pos * max_positions * np.dtype(dtype).itemsize, dtype)
