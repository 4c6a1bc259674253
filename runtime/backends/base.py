"""The one interface every target backend implements (numpy reference, ONNX Runtime, GGUF, TensorRT).

A backend owns the model weights and ONE KV cache (a view into the process's KV arena). The engine
drives it with explicit positions and an explicit attention mask, so a flattened draft tree is verified
in a single `forward`; afterwards `keep` compacts the cache to the accepted path.

Hidden-state taps are named strings:
  "layer_in.{i}"  the hidden state entering decoder layer i (i = 0 is the embedding output)
  "layer_out.{i}" the hidden state leaving decoder layer i
  "final_norm"    the last layer's output after the final RMSNorm (what the LM head reads)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Protocol, Sequence

import numpy as np

from runtime.model.spec import ModelSpec


def parse_tap(name: str, num_layers: int):
    """'layer_in.3' -> ('layer_in', 3); 'final_norm' -> ('final_norm', None). Raises ValueError if unknown."""
    if name == "final_norm":
        return ("final_norm", None)
    kind, _, idx = name.partition(".")
    if kind in ("layer_in", "layer_out") and idx.isdigit() and 0 <= int(idx) < num_layers:
        return (kind, int(idx))
    raise ValueError(f"unknown hidden tap {name!r}: expected layer_in.i / layer_out.i (0 <= i < {num_layers}) or final_norm")


@dataclass
class ForwardResult:
    logits: np.ndarray  # (T, V) float32, one row per new token
    taps: Dict[str, np.ndarray] = field(default_factory=dict)  # name -> (T, H) float32


class TargetBackend(Protocol):
    spec: ModelSpec
    name: str  # "numpy_ref", "onnx", ...

    @property
    def cache_len(self) -> int:
        """Number of positions currently held in the KV cache (rows 0 .. cache_len-1)."""

    @property
    def max_cache_len(self) -> int:
        """Rows the KV cache can hold (fixed by the memory budget)."""

    def forward(
        self,
        tokens: np.ndarray,  # (T,) int
        positions: np.ndarray,  # (T,) int, rope positions of the new tokens
        mask: Optional[np.ndarray] = None,  # (T, cache_len + T) bool, True = may attend; None = causal
        taps: Sequence[str] = (),
    ) -> ForwardResult:
        """Run T new tokens against the cache, append their K/V as rows cache_len .. cache_len+T-1."""

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Keep rows [0, start) and then the listed rows (absolute indices, ascending) moved to be
        contiguous from `start`; everything after is dropped. `keep(n, [])` truncates to n rows."""

    def reset(self) -> None:
        """Forget the whole cache (cache_len = 0)."""


class CacheRows:
    """The KV bookkeeping every backend shares: `self.cache` is its view of the arena (runtime/memory/kv.py), and
    these read through to it. A backend whose cache is not only rows (llama.cpp's) overrides `reset`."""

    cache: object

    @property
    def cache_len(self) -> int:
        return self.cache.length

    @property
    def max_cache_len(self) -> int:
        return self.cache.max_positions

    def reset(self) -> None:
        self.cache.reset()
