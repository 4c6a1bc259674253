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

from runtime.config import MemoryConfig
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


PREFILL_CHUNK = MemoryConfig.prefill_chunk  # tokens per prefill forward, memory.prefill_chunk's default


def forward_in_chunks(target: TargetBackend, tokens: np.ndarray, positions: np.ndarray, taps: Sequence[str] = (),
                      chunk: int = PREFILL_CHUNK, all_logits: bool = True) -> ForwardResult:
    """A causal forward of T tokens as ceil(T / chunk) consecutive causal forwards of <= `chunk` tokens: chunk j
    attends to the cache (earlier chunks included) and causally to itself, which is row for row the mask of the
    one causal forward, so its logits and taps are the same within the backend's precision. Only the forward's
    scratch (activations, scores, the chunk's logits) is bounded by the chunk; the taps come out as one forward's,
    rows concatenated (T, H). `all_logits` False keeps only the last row's logits (1, V): what a prefill samples
    its first token from, without holding T x V floats.

    Example: 1100 prompt tokens, chunk 512 -> forwards of 512, 512 and 76 tokens at positions 0.., 512.., 1024..;
    the result holds 1100 rows of each tap and (all_logits False) the logits of position 1099."""
    tokens = np.asarray(tokens, np.int64)
    positions = np.asarray(positions, np.int64)
    if chunk < 1 or len(tokens) == 0:
        raise ValueError(f"a chunked forward of {len(tokens)} tokens in chunks of {chunk}: expected >= 1 of each")
    names = list(dict.fromkeys(taps))  # a tap named twice (EAGLE-3's on a shallow target) is one tap
    logits, got = [], {name: [] for name in names}
    # A backend that can leave out the rows not kept (gguf: its LM head then runs on one row) is told so.
    partial = {"all_logits": False} if not all_logits and getattr(target, "partial_logits", False) else {}
    for s in range(0, len(tokens), chunk):
        res = target.forward(tokens[s:s + chunk], positions[s:s + chunk], None, tuple(names), **partial)
        last = s + chunk >= len(tokens)
        if all_logits or last:
            logits.append(res.logits if all_logits else res.logits[-1:])
        for name in names:
            got[name].append(res.taps[name])
    one = len(logits) == 1  # a prompt within one chunk: no copy
    return ForwardResult(logits=logits[0] if one else np.concatenate(logits),
                         taps={n: v[0] if len(v) == 1 else np.concatenate(v) for n, v in got.items()})
