"""The feature cache: the frozen target's taps and top-k logits over a fixed set of packed rows, computed once and
read back memory-mapped by every drafter kind and every epoch (the target's forward is most of a step's cost).

    work/features/<key>/meta.json                 rows, seq_len, top_k, dtype, fill seconds per shard
    work/features/<key>/s00000.ids.npy            (R, T) int32 token ids      } one file per shard of R rows
    work/features/<key>/s00000.doc.npy            (R, T) int32 document index }
    work/features/<key>/s00000.logit_val.npy      (R, T, k) the target's k largest logits (dtype)
    work/features/<key>/s00000.logit_idx.npy      (R, T, k) int32 their token ids
    work/features/<key>/s00000.<tap>.npy          (R, T, H) one target hidden state (dtype), e.g. layer_in.2

key = sha256(target fingerprint, the rows' ids and documents, k, dtype)[:16]; a tap is its own file under it,
so a kind that reads other taps (EAGLE-3's layer inputs, DFlash's layer outputs) adds its files to the same
cache instead of recomputing the rest. Each file is written under a temporary name and renamed; under torchrun
process r fills shards r, r + world, ... A batch read from the cache equals the target's on-the-fly batch of the
same rows with the same top-k (tested; exactly so with dtype float32, to fp16 rounding with float16)."""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from export.drafters.trainer import (LazyBatches, TargetBatch, TrainConfig, frozen_embed_head, packed_layout,
                                     target_batch, top_k_and_rest)

DTYPES = ("float32", "float16")


def cache_rows(data: Dict[str, list], cfg: TrainConfig, n_rows: int, split: str = "train",
               first: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """n_rows packed rows (ids, doc), each (n_rows, T) int32: RowSampler batches first, first+1, ... (so a cache
    holds exactly the rows an on-the-fly run would see first). n_rows is rounded up to whole batches."""
    from export.drafters.trainer import RowSampler

    rows = RowSampler(data, cfg, split)
    ids, doc = [], []
    for i in range(-(-n_rows // cfg.batch)):
        a, b = rows.batch(first + i)
        ids.append(a.numpy())
        doc.append(b.numpy())
    return np.concatenate(ids).astype(np.int32), np.concatenate(doc).astype(np.int32)


class FeatureCache:
    """One target's features over the rows (ids, doc) (see the module doc)."""

    def __init__(self, root: str, target, ids: np.ndarray, doc: np.ndarray, top_k: int, dtype: str = "float32",
                 shard_rows: int = 64):
        if dtype not in DTYPES:
            raise ValueError(f"feature cache dtype {dtype!r}: expected one of {DTYPES}")
        if top_k < 1:
            raise ValueError("the feature cache keeps the top-k logits: top_k must be >= 1")
        self.target, self.ids, self.doc, self.top_k, self.dtype = target, ids, doc, top_k, dtype
        h = hashlib.sha256()
        h.update(getattr(target, "fingerprint", "").encode() or _weights_hash(target))
        h.update(ids.tobytes())
        h.update(doc.tobytes())
        h.update(f"{top_k}:{dtype}".encode())
        self.key = h.hexdigest()[:16]
        self.dir = os.path.join(root, self.key)
        self.shard_rows = shard_rows
        self.shards = -(-len(ids) // shard_rows)
        self._open: Dict[str, np.ndarray] = {}

    def _file(self, shard: int, name: str) -> str:
        return os.path.join(self.dir, f"s{shard:05d}.{name}.npy")

    def missing(self, shard: int, taps: Sequence[str]) -> Tuple[str, ...]:
        names = ("ids", "doc", "logit_val", "logit_idx", "logit_rest") + tuple(taps)
        return tuple(n for n in names if not os.path.isfile(self._file(shard, n)))

    def fill(self, taps: Sequence[str], batch: int, rank: int = 0, world: int = 1, log=print) -> float:
        """Compute what is missing for `taps` (this process's shards), in batches of `batch` rows. -> seconds
        the target's forward over ALL rows takes (measured now, or recorded when the cache was filled)."""
        os.makedirs(self.dir, exist_ok=True)
        meta = self._meta()
        todo = [s for s in range(rank, self.shards, world) if self.missing(s, taps)]
        if todo and rank == 0:
            log(f"feature cache {self.dir}: computing {', '.join(sorted(set(sum((self.missing(s, taps) for s in todo), ()))))}"
                f" for {len(todo)} of {self.shards} shards ({len(self.ids)} rows of {self.ids.shape[1]} tokens)")
        for s in todo:
            t0 = time.time()
            need = self.missing(s, taps)
            rows = slice(s * self.shard_rows, min((s + 1) * self.shard_rows, len(self.ids)))
            out: Dict[str, list] = {n: [] for n in need}
            for a in range(rows.start, rows.stop, batch):
                b = min(a + batch, rows.stop)
                tb = target_batch(self.target, torch.from_numpy(self.ids[a:b]).long(),
                                  torch.from_numpy(self.doc[a:b]).long(), [t for t in need if t in taps])
                vals, idx, rest = top_k_and_rest(tb.logits, self.top_k)
                got = {"ids": self.ids[a:b], "doc": self.doc[a:b], "logit_val": vals.cpu().numpy().astype(self.dtype),
                       "logit_idx": idx.cpu().numpy().astype(np.int32), "logit_rest": rest.cpu().numpy().astype(np.float32),
                       **{t: v.cpu().numpy().astype(self.dtype) for t, v in tb.taps.items()}}
                for n in need:
                    out[n].append(got[n])
            for n, parts in out.items():
                _save(self._file(s, n), np.concatenate(parts))
            if "logit_val" in need:  # the full forward's cost of this shard: what every on-the-fly epoch pays
                meta.setdefault("fill_s", {})[str(s)] = time.time() - t0
        if todo:
            self._write_meta(meta, rank)
        return self.forward_seconds()

    def forward_seconds(self) -> float:
        """The recorded seconds of the target's forward over all rows (scaled up from the shards measured)."""
        fill = self._meta().get("fill_s", {})
        return sum(fill.values()) * self.shards / len(fill) if fill else 0.0

    def _meta(self) -> dict:
        path = os.path.join(self.dir, "meta.json")
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return {"rows": len(self.ids), "seq_len": int(self.ids.shape[1]), "top_k": self.top_k, "dtype": self.dtype,
                "shard_rows": self.shard_rows}

    def _write_meta(self, meta: dict, rank: int) -> None:
        merged = self._meta()
        merged.setdefault("fill_s", {}).update(meta.get("fill_s", {}))
        _save_json(os.path.join(self.dir, "meta.json"), merged, rank)

    def _array(self, shard: int, name: str) -> np.ndarray:
        key = f"{shard}.{name}"
        if key not in self._open:
            self._open[key] = np.load(self._file(shard, name), mmap_mode="r")  # our own .npy files, no pickles
        return self._open[key]

    def read(self, rows: np.ndarray, name: str) -> np.ndarray:
        """The stored array `name` for these row indices, stacked (len(rows), ...)."""
        return np.stack([self._array(int(r) // self.shard_rows, name)[int(r) % self.shard_rows] for r in rows])

    def batch(self, rows: np.ndarray, taps: Sequence[str], device: str = "cpu") -> TargetBatch:
        """The TargetBatch of these rows from the cache: the top k and the rest's log-sum-exp, as on the fly."""
        t = self.target
        ids = torch.from_numpy(self.read(rows, "ids")).long().to(device)
        doc = torch.from_numpy(self.read(rows, "doc")).long().to(device)
        positions, mask = packed_layout(doc)
        vals = torch.from_numpy(self.read(rows, "logit_val").astype(np.float32)).to(device)
        idx = torch.from_numpy(self.read(rows, "logit_idx")).long().to(device)
        logits = torch.full(vals.shape[:2] + (t.cfg.vocab_size,), float("-inf"), device=device).scatter_(-1, idx, vals)
        rest = torch.from_numpy(self.read(rows, "logit_rest")).to(device)
        logits = torch.cat([logits, rest[..., None]], -1)  # trainer.keep_top_k's layout
        got = {n: torch.from_numpy(self.read(rows, n).astype(np.float32)).to(device) for n in taps}
        return TargetBatch(ids, positions, mask, doc, logits, got, *frozen_embed_head(t))


class CachedSource:
    """Training batches from a FeatureCache: epoch e visits every cached row once, in an order that is a pure
    function of (seed, e), so a resumed run reads the same batch i. Logs an epoch's time against the target's."""

    def __init__(self, cache: FeatureCache, cfg: TrainConfig, taps: Sequence[str], device: str = "cpu"):
        n = len(cache.ids)
        if n % cfg.batch:
            raise ValueError(f"{n} cached rows are not whole batches of {cfg.batch}")
        self.cache, self.cfg, self.taps, self.device, self.n = cache, cfg, tuple(taps), device, n
        self._epoch_t0: Optional[float] = None

    def rows(self, i: int) -> np.ndarray:
        B = self.cfg.batch
        epoch, at = divmod(i * B, self.n)
        order = np.random.default_rng([self.cfg.seed, 977, epoch]).permutation(self.n)
        return order[at:at + B]

    def batch(self, i: int, mine: slice = slice(None)) -> TargetBatch:
        return self.cache.batch(self.rows(i)[mine], self.taps, self.device)

    def epoch_done(self, step: int, seconds: float, log) -> None:
        """Called after each step (seconds since this run's first step began): at an epoch's end, say what the
        epoch cost against the target computing its rows (a resumed run's partial epoch is scaled up)."""
        per_epoch = self.n // self.cfg.batch
        if self._epoch_t0 is None:
            self._epoch_t0, self._from = 0.0, step - 1
        if step % per_epoch:
            return
        ran = step - max(self._from, step - per_epoch)
        took = (seconds - self._epoch_t0) * per_epoch / ran
        self._epoch_t0, self._from = seconds, step
        fwd = self.cache.forward_seconds()
        log(f"epoch {step // per_epoch} ({per_epoch} steps) from the feature cache: {took:.1f} s; the target's forward "
            f"over these rows takes {fwd:.1f} s, so on the fly it would take ~{took + fwd:.1f} s "
            f"(the cache: {(took + fwd) / max(took, 1e-9):.1f}x faster)")


def heldout_batches(cache: FeatureCache, taps: Sequence[str], batch: int, device: str = "cpu") -> LazyBatches:
    """Every row of a held-out cache, as batches of `batch` rows read when iterated (the evaluation set)."""
    n = len(cache.ids)
    return LazyBatches(lambda i: cache.batch(np.arange(i * batch, min((i + 1) * batch, n)), taps, device),
                       -(-n // batch))


def _weights_hash(target) -> bytes:
    h = hashlib.sha256()
    for k, v in target.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest().encode()


def _save(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def _save_json(path: str, doc: dict, rank: int) -> None:
    tmp = f"{path}.{rank}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
