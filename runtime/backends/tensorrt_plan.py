"""What a TensorRT engine of a bundle model is built for, and where its inputs and outputs lie in device
memory: pure functions shared by `edgespec export --to tensorrt` (export/tensorrt/build.py, which builds the
engines) and runtime/backends/tensorrt.py (which runs them). Nothing here imports TensorRT or CUDA, so all
of it is tested on machines that have neither.

An engine is built from the bundle's ONNX graph (export/onnx/graph.py), so it has the same I/O:
  input_ids (T,)  position_ids (T,)  attention_mask (T, S=P+T)  past_key_i / past_value_i (P, nkv, d)
  -> logits (T, V), tap_* (T, H), new_key_i / new_value_i (T, nkv, d)
and two optimisation profiles: "verify" (T <= the largest draft tree + 1: decode steps and tree verifies, the
hot path) and "prefill" (T up to a whole prompt). The KV cache is explicit I/O: past_key_i is bound to the first
P rows of layer i's block in the one device KV buffer and new_key_i to the next T rows, the layer-major layout
the ONNX backend uses on the host arena (runtime/backends/onnx.py), so the device buffer is a byte-for-byte
image of the host arena's layout."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from runtime.errors import BackendError, BudgetExceeded

KV_LAYOUT = "layer_major"  # each cache's bytes read as (L, max_positions, nkv, d), K block then V block
PROFILE_NAMES = ("verify", "prefill")  # profile index 0, 1 in every engine edgespec builds
Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: the largest forward it takes and each input's (min, opt, max) shape."""
    name: str
    max_tokens: int  # T
    max_positions: int  # P + T, the rows of the cache
    shapes: Dict[str, Tuple[Shape, Shape, Shape]]


def engine_profiles(num_layers: int, num_kv_heads: int, head_dim: int, max_positions: int, verify_tokens: int,
                    prefill_tokens: int) -> Tuple[Profile, Profile]:
    """The verify and prefill profiles of a decoder engine whose cache holds `max_positions` rows.

    P may be 0 (the first prefill of an empty cache: TensorRT takes empty tensors), T is at least 1 and
    S = P + T never exceeds the cache. opt is the shape TensorRT tunes its kernels for: a full tree over
    half the cache for verify, a whole prompt over an empty cache for prefill.
    Example: 2 layers, 4 KV heads, d 32, 1024 rows, trees of 9, prompts of 512:
      verify  input_ids ((1,), (9,), (9,))       past_key_0 ((0,4,32), (512,4,32), (1023,4,32))
              attention_mask ((1,1), (9,521), (9,1024))
      prefill input_ids ((1,), (512,), (512,))   attention_mask ((1,1), (512,512), (512,1024))"""
    if not 1 <= verify_tokens <= prefill_tokens <= max_positions:
        raise ValueError(f"profile sizes must satisfy 1 <= verify tokens ({verify_tokens}) <= prefill tokens "
                         f"({prefill_tokens}) <= cache rows ({max_positions})")
    out = []
    for name, t_max, t_opt, p_opt in (("verify", verify_tokens, verify_tokens, max_positions // 2),
                                      ("prefill", prefill_tokens, prefill_tokens, 0)):
        p_opt = min(p_opt, max_positions - t_opt)
        shapes: Dict[str, Tuple[Shape, Shape, Shape]] = {
            "input_ids": ((1,), (t_opt,), (t_max,)),
            "position_ids": ((1,), (t_opt,), (t_max,)),
            "attention_mask": ((1, 1), (t_opt, p_opt + t_opt), (t_max, max_positions)),
        }
        kv = ((0, num_kv_heads, head_dim), (p_opt, num_kv_heads, head_dim), (max_positions - 1, num_kv_heads, head_dim))
        for i in range(num_layers):
            shapes[f"past_key_{i}"] = kv
            shapes[f"past_value_{i}"] = kv
        out.append(Profile(name, t_max, max_positions, shapes))
    return out[0], out[1]


def profiles_to_params(profiles: Sequence[Profile]) -> Dict[str, Dict[str, int]]:
    """What bundle.yaml records of the profiles: {name: {max_tokens, max_positions}} in index order."""
    return {p.name: {"max_tokens": p.max_tokens, "max_positions": p.max_positions} for p in profiles}


def pick_profile(profiles: Mapping[str, Mapping[str, int]], t: int, p: int, engine: str) -> int:
    """Index of the profile that runs T new tokens over P cached rows: verify where it fits (its kernels are
    tuned for short T), else prefill. A forward no profile takes raises, naming the limit and the fix.
    pick_profile({"verify": {max_tokens: 9, ..}, "prefill": {max_tokens: 512, ..}}, 5, 100, e) == 0; T=40 -> 1."""
    names = list(profiles)
    rows = min(int(v["max_positions"]) for v in profiles.values())
    if p + t > rows:
        raise BudgetExceeded(f"{engine}: {p} cached + {t} new rows exceed the {rows} rows the engine was built "
                             "for; shorten the request, or rebuild the engines with a larger --max-context")
    for i, name in enumerate(names):
        if t <= int(profiles[name]["max_tokens"]):
            return i
    raise BackendError(f"{engine}: a forward of {t} tokens is longer than every profile "
                       f"({', '.join(n + ' <= ' + str(v['max_tokens']) for n, v in profiles.items())}); rebuild the engines "
                       "with a larger --prefill-tokens")


# -- the device KV buffer --------------------------------------------------------------------------

def cache_offsets(k: np.ndarray, v: np.ndarray) -> Tuple[int, int, int]:
    """(K offset, V offset, arena bytes) of a KVCache's K/V views inside the host arena they were carved
    from (runtime.memory.kv.KVArena): the same offsets index the one device buffer that mirrors the arena."""
    base = k.base
    if base is None or v.base is not base:
        raise ValueError("K and V of a cache must be views of one arena buffer (runtime.memory.kv.KVArena.allocate)")
    start = base.__array_interface__["data"][0]
    return k.__array_interface__["data"][0] - start, v.__array_interface__["data"][0] - start, base.nbytes


def kv_addresses(device_base: int, k_offset: int, v_offset: int, num_layers: int, max_positions: int,
                 row_bytes: int, p: int) -> Dict[str, int]:
    """Device address of every KV tensor of one forward over `p` cached rows, in the layer-major layout:
    layer i's block starts at i x max_positions rows; past_* is its first p rows, new_* the rows after them.
    Example: base 0x1000, K at 0, V at 4096, 2 layers, 8 rows of 128 B, p = 3:
      past_key_0 0x1000  new_key_0 0x1000+384  past_key_1 0x1000+1024  new_value_1 0x1000+4096+1024+384."""
    out = {}
    block = max_positions * row_bytes
    for i in range(num_layers):
        k = device_base + k_offset + i * block
        v = device_base + v_offset + i * block
        out[f"past_key_{i}"], out[f"past_value_{i}"] = k, v
        out[f"new_key_{i}"], out[f"new_value_{i}"] = k + p * row_bytes, v + p * row_bytes
    return out


def row_moves(start: int, rows: Sequence[int]) -> List[Tuple[int, int, int]]:
    """The copies (src row, dst row, count) that compact a cache after a verify: rows [0, start) stay, then
    `rows` (ascending, >= start) move to start, start+1, ... Rows already in place are not copied; consecutive
    rows go in one copy when source and destination do not overlap (a device 2-D copy may not overlap), and the
    copies must run in order (each source lies at or after every earlier destination).
    row_moves(10, [10, 12, 15]) == [(12, 11, 1), (15, 12, 1)];  row_moves(4, [7, 8, 9]) == [(7, 4, 3)]."""
    moves: List[Tuple[int, int, int]] = []
    for j, src in enumerate(rows):
        dst = start + j
        if src == dst:
            continue
        if moves:
            s, d, n = moves[-1]
            if s + n == src and d + n == dst and n + 1 <= s - d:  # extend while it stays overlap-free
                moves[-1] = (s, d, n + 1)
                continue
        moves.append((src, dst, 1))
    return moves


# -- versions ---------------------------------------------------------------------------------------

def parse_l4t_release(text: str) -> Optional[str]:
    """The L4T version from /etc/nv_tegra_release: "# R36 (release), REVISION: 4.3, GCID: ..." -> "36.4.3"."""
    m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def version_mismatch(built: Mapping[str, object], here: Mapping[str, object], engine: str, bundle: str) -> Optional[str]:
    """Why an engine built under `built` cannot run under `here` (None if it can). A TensorRT engine is tied
    to the TensorRT version that built it and to the GPU's compute capability (engines are not portable);
    the L4T release is compared too, since a JetPack upgrade changes the TensorRT and CUDA underneath."""
    rebuild = f"rebuild the engines on this device with `edgespec export --to tensorrt --bundle {bundle}`"
    for key, what in (("tensorrt_version", "TensorRT"), ("compute_capability", "GPU compute capability"),
                      ("l4t_version", "L4T (JetPack) release")):
        a, b = built.get(key), here.get(key)
        if a is None and key == "l4t_version":
            continue  # built off a Jetson: nothing to compare
        if str(a) != str(b):
            return f"{engine} was built with {what} {a}, this machine has {b}; {rebuild}"
    return None


# -- CUDA graphs ------------------------------------------------------------------------------------

GRAPH_BUCKET = 64  # past rows are padded up to a multiple of this for a captured forward


def graph_bucket(p: int, t: int, max_tokens: int, rows: int, bucket: int = GRAPH_BUCKET) -> Optional[int]:
    """The padded past length B a captured CUDA graph runs a forward of T tokens over P rows with, or None
    where no graph applies (T beyond the verify profile, or the padded forward beyond the cache). A graph replays
    fixed shapes and addresses, and P grows every step; padding P up to a bucket lets one graph serve `bucket`
    consecutive steps. graph_bucket(0, 1, 9, 1024) == 0; (1, 1, ..) -> 64; (64, 5, ..) -> 64; (65, 5, ..) -> 128."""
    b = -(-p // bucket) * bucket
    return b if t <= max_tokens and b + t <= rows and b <= rows - 1 else None


def padded_mask(add_mask: np.ndarray, p: int, b: int) -> np.ndarray:
    """(T, P+T) additive mask -> (T, B+T) for a past padded to B rows: the padding rows [P, B) hold stale but
    finite K/V and get -inf, so softmax gives them probability exactly 0 and they add exact zeros."""
    t = add_mask.shape[0]
    out = np.full((t, b + t), -np.inf, np.float32)
    out[:, :p] = add_mask[:, :p]
    out[:, b:] = add_mask[:, p:]
    return out
