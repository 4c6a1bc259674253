"""The llama.cpp target backend: a GGUF (f16, q8_0, q4_K_M) run through llama-cpp-python's low-level API.

llama.cpp owns its KV cache (f16 K/V, sized from the same budget as every backend: `n_ctx` is the
positions the session's plan gives this model). It has no attention-mask input: a token attends to the
cached cells that share its sequence id and whose position is not after its own. A draft tree is
therefore written with sequence ids (a unified KV cache lets one cell carry several):

    committed rows   positions 0..C-1, in sequence 0 and copied (no data moved) to every branch sequence
    tree rows        each leaf of the tree gets its own sequence; a node carries the sequences of every
                     leaf below it and queries with the first of them, so it sees exactly its ancestors.

Worked example: root r (pos C) with children a, b (pos C+1) and a's child c (pos C+2). Leaves b, c get
sequences 0, 1: r carries {0, 1}, b {0}, a and c {1}. Query b (seq 0) sees the committed rows, r and
itself; a and c are not in sequence 0. Query a (seq 1) sees r and a; c is in seq 1 but at pos C+2 > C+1.

`forward` derives the sequences from the mask it is given and checks that llama.cpp's rule reproduces
that mask exactly (else BackendError: no forward runs with an attention pattern other than the one
asked). `keep` turns the kept path into sequence 0 (llama_memory_seq_cp / seq_rm: bookkeeping, no K/V
copied) and drops every other row. Hidden state: "final_norm" comes from llama.cpp's embeddings output
(pooling none) in the same decode; per-layer taps are not exposed, and asking for one is refused when
the session is opened.

llama.cpp is built non-native (scripts/bootstrap.sh): a -march=native build turns on the AMX kernels
on CPUs that advertise AMX and q8_0 models then die with SIGILL on some VMs. Flash attention is off
(on CPU it made batched verification up to 7x slower, measured) and threads are the core count, on one
persistent threadpool attached as llama.cpp's own tools attach theirs.

Per step the Python side stays off the per-token path: the batch is preallocated and filled through numpy views
of its C arrays, and only the logits rows asked for are computed and copied out (a prefill's last row:
`all_logits=False`; `logit_rows_fetched` counts them)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from runtime.backends.base import CacheRows, ForwardResult, parse_tap
from runtime.errors import BackendError
from runtime.memory.kv import KVCache
from runtime.model.spec import ModelSpec

SUPPORTED_TAPS = ("final_norm",)
MAX_SEQUENCES = 64  # branch sequences a tree may use (leaves per verify forward); llama.cpp allows 256
CTX_PAD = 256
_INSTALL = ("the gguf backend needs llama-cpp-python, built non-native (`scripts/bootstrap.sh` builds and caches it; "
            "elsewhere `CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" "
            "pip install llama-cpp-python`)")

_lock = threading.Lock()
_state: Dict[str, object] = {}
_log_tail: deque = deque(maxlen=20)  # llama.cpp's recent log lines, quoted in errors instead of printed


def _lib():
    """llama_cpp, initialised once, with its log routed into `_log_tail` (kept referenced: a collected
    ctypes callback would crash the next log call)."""
    with _lock:
        if "lib" not in _state:
            try:
                import llama_cpp
            except ImportError:
                raise BackendError(_INSTALL) from None

            def on_log(level, text, user_data):
                line = text.decode(errors="replace") if text else ""
                _log_tail.append(line.rstrip())
                if _state.get("echo"):
                    sys.stderr.write(line)

            callback = llama_cpp.llama_log_callback(on_log)
            llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _state.update(lib=llama_cpp, log_callback=callback)
        return _state["lib"]


def library():
    """llama_cpp (llama-cpp-python), its log kept for error messages rather than printed (BackendError if absent)."""
    return _lib()


def recent_log() -> str:
    """"; llama.cpp said: ..." with its last few log lines, or "" (for errors of llama.cpp calls made elsewhere)."""
    return _recent_log()


def echo_library_log(on: bool) -> None:
    """Also print llama.cpp's log lines to stderr (`edgespec export --verbose`); by default only the last few
    are kept, quoted in the error when a call fails."""
    _state["echo"] = bool(on)


def _recent_log() -> str:
    lines = [line for line in _log_tail if line.strip()]
    return ("; llama.cpp said: " + " | ".join(lines[-3:])) if lines else ""


class _PoolParams(ctypes.Structure):
    """ggml.h's struct ggml_threadpool_params (GGML_MAX_N_THREADS = 512)."""
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def _threadpool_api():
    """(new, free, attach) C functions for a persistent ggml CPU threadpool, or None where this llama-cpp-python
    build does not export them. Found the way llama.cpp's own tools find them (common/common.cpp): through the CPU
    backend's registry, so a build with ggml-cpu linked in or loaded as a module both work."""
    with _lock:
        if "pool_api" not in _state:
            _state["pool_api"] = None
            try:
                from llama_cpp import _ggml
                from llama_cpp import llama_cpp as raw
                g = _ggml.libggml
                g.ggml_backend_dev_by_type.argtypes, g.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
                g.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
                g.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
                g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
                g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
                dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
                reg = g.ggml_backend_dev_backend_reg(dev) if dev else None
                new = g.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_new") if reg else None
                free = g.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_free") if reg else None
                attach = raw._lib.llama_attach_threadpool
                attach.argtypes, attach.restype = [ctypes.c_void_p] * 3, None
                if new and free:
                    _state["pool_api"] = (ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_PoolParams))(new),
                                          ctypes.CFUNCTYPE(None, ctypes.c_void_p)(free), attach)
            except (ImportError, AttributeError, OSError):
                pass
        return _state["pool_api"]


def _attach_threadpool(ctx, threads: int):
    """A threadpool of `threads` attached to `ctx` as llama.cpp's tools attach theirs (poll 50, their default), so
    decodes reuse it; the pointer to free after the context, or None. Without one ggml builds a disposable pool
    inside every llama_decode: a struct in an OpenMP build (the bootstrap's: its OpenMP workers persist anyway),
    threads started and joined per decode in a build without OpenMP."""
    api = _threadpool_api()
    if api is None or threads < 2:  # one thread computes on the caller's: no pool to keep
        return None
    new, _, attach = api
    params = _PoolParams(n_threads=threads, prio=0, poll=50, strict_cpu=False, paused=False)
    pool = new(ctypes.byref(params))
    if pool:
        attach(ctx, pool, None)  # NULL batch pool: the same pool serves batches (llama_context::attach_threadpool)
    return pool or None


@dataclass
class _TreeRows:
    """Rows past the committed prefix: rope position and sequence ids of each (index = row - committed)."""
    pos: List[int] = field(default_factory=list)
    seqs: List[frozenset] = field(default_factory=list)
    used: set = field(default_factory=lambda: {0})  # sequences that currently see the committed rows


def assign_sequences(positions: np.ndarray, mask: np.ndarray, committed: int, tree: _TreeRows):
    """Sequence ids that make llama.cpp attend as `mask` says, for T new tokens over `committed` +
    len(tree.pos) cached rows. Returns (query seq per token, seq set per token, fresh seqs to open)
    or raises BackendError when the mask is not a pattern sequences can express.

    Rule checked at the end: token i sees row r iff r is committed, or query_seq(i) is in seqs(r) and
    pos(r) <= pos(i). Each new leaf (a token no other new token sees) picks a sequence whose cached tree
    rows are what it must see (sequence 0 first), or a fresh one when it must see none of them."""
    t = len(positions)
    old = len(tree.pos)
    new = mask[:, committed + old:]  # (T, T)
    if committed and not mask[:, :committed].all():
        raise BackendError("llama.cpp backend: a token may not hide committed rows (the mask's prefix must be all True)")
    if (positions < committed).any():
        raise BackendError(f"llama.cpp backend: positions {positions.tolist()} reach into the {committed} committed rows")
    seen_by = [[i for i in range(t) if new[i, j]] for j in range(t)]
    leaves = [j for j in range(t) if seen_by[j] == [j]]
    taken: set = set()
    leaf_seq: Dict[int, int] = {}
    fresh: List[int] = []
    for leaf in leaves:
        wanted = {r for r in range(old) if mask[leaf, committed + r]}
        choice = None
        for s in sorted(tree.used - taken):
            if {r for r in range(old) if s in tree.seqs[r] and tree.pos[r] <= positions[leaf]} == wanted:
                choice = s
                break
        if choice is None and not wanted:
            choice = next(s for s in range(MAX_SEQUENCES + 1) if s not in tree.used and s not in taken)
            if choice >= MAX_SEQUENCES:
                raise BackendError(f"llama.cpp backend: a tree with more than {MAX_SEQUENCES} leaves; draft fewer branches")
            fresh.append(choice)
        if choice is None:
            raise BackendError("llama.cpp backend: the mask cannot be written with sequence ids (a token sees a set of "
                               "cached draft rows no sequence holds)")
        taken.add(choice)
        leaf_seq[leaf] = choice
    seqs = [frozenset(leaf_seq[i] for i in seen_by[j] if i in leaf_seq) for j in range(t)]
    query = []
    for i in range(t):
        below = [leaf_seq[leaf] for leaf in leaves if new[leaf, i]]
        if not below:
            raise BackendError("llama.cpp backend: a token's own row is hidden from it in the mask")
        query.append(min(below))
    # The attention llama.cpp will compute, compared with the one asked for.
    all_pos = np.asarray(list(tree.pos) + positions.tolist(), np.int64)  # (old+T,)
    all_seqs = list(tree.seqs) + seqs
    member = np.zeros((MAX_SEQUENCES, old + t), bool)  # member[s, r]: row r is in sequence s
    for r, ss in enumerate(all_seqs):
        member[list(ss), r] = True
    got = member[query] & (all_pos[None, :] <= positions[:, None])  # (T, old+T)
    if not np.array_equal(got, mask[:, committed:]):
        bad = np.argwhere(got != mask[:, committed:])[0]
        raise BackendError(f"llama.cpp backend: the mask cannot be written with sequence ids (token {bad[0]} and row "
                           f"{committed + bad[1]}: positions must grow along every path and a row may be hidden only "
                           "from tokens off its branch)")
    return query, seqs, fresh


class LlamaCppTarget(CacheRows):
    """A GGUF decoder run by llama.cpp, implementing runtime.backends.base.TargetBackend."""

    name = "gguf"

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("llama_cpp") is not None

    def __init__(self, spec: ModelSpec, model_path: str, cache: KVCache, threads: int = 0,
                 tap_names: Sequence[str] = (), max_batch: int = 512):
        for tap in tap_names:
            parse_tap(tap, spec.num_layers)
            if tap not in SUPPORTED_TAPS:
                raise BackendError(f"the gguf (llama.cpp) backend gives only the {list(SUPPORTED_TAPS)} hidden state; "
                                   f"tap {tap!r} is not available: choose a drafter that does not read it, or use the "
                                   "onnx / numpy_ref backend")
        if not os.path.isfile(model_path):
            raise BackendError(f"{model_path}: no such GGUF file; export it with `edgespec export --to gguf --bundle DIR`")
        lib = _lib()
        self.lib = lib
        self.spec = spec
        self.cache = cache
        self.model_path = model_path
        self.tap_names = tuple(tap_names)
        self.threads = threads or os.cpu_count() or 1
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise BackendError(f"{model_path}: llama.cpp could not load the GGUF{_recent_log()}; re-export it")
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        n_embd = lib.llama_model_n_embd(self.model)
        if n_vocab != spec.vocab_size or n_embd != spec.hidden_size:
            self._free_model()
            raise BackendError(f"{model_path}: vocab {n_vocab} x hidden {n_embd}, the bundle's spec says "
                               f"{spec.vocab_size} x {spec.hidden_size}; re-export the GGUF from this bundle")
        # llama.cpp rounds its cache up to a multiple of 256 positions (CTX_PAD) and caps a batch at n_ctx; a
        # batch must also hold one output per sequence. Our own limit stays cache.max_positions.
        n_ctx = -(-cache.max_positions // CTX_PAD) * CTX_PAD
        self.max_batch = min(max(MAX_SEQUENCES, int(max_batch)), n_ctx)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = cparams.n_outputs_max = self.max_batch
        cparams.n_seq_max = MAX_SEQUENCES
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.kv_unified = True
        cparams.embeddings = "final_norm" in self.tap_names
        cparams.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        cparams.type_k = cparams.type_v = lib.GGML_TYPE_F16
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self._free_model()
            raise BackendError(f"{model_path}: llama.cpp could not create a context of {cache.max_positions} positions"
                               f"{_recent_log()}; lower max_context or the memory budget")
        self.pool = _attach_threadpool(self.ctx, self.threads)
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(self.max_batch, 0, MAX_SEQUENCES)
        # Views over the batch's C arrays: a batch is filled by numpy slices, not a Python loop per token.
        b, n = self.batch, self.max_batch
        self._token = np.ctypeslib.as_array(b.token, shape=(n,))  # (max_batch,) int32
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))  # (max_batch,) int32
        self._n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))  # (max_batch,) int32
        self._wants = np.ctypeslib.as_array(b.logits, shape=(n,))  # (max_batch,) int8: 1 = output this row
        self._views: Dict[tuple, np.ndarray] = {}  # (address, width) -> view of a llama.cpp output buffer
        self._first_seq = np.full(n, -1, np.int32)  # mirror of seq_id[i][0], so chain batches skip writing it
        self._tree_rows = True  # rows of _first_seq may not be 0 (never written, or a tree batch wrote them)
        self.committed = 0
        self.tree = _TreeRows()
        self.weight_bytes = int(lib.llama_model_size(self.model))
        self.logit_rows_fetched = 0  # (V,) rows copied out of llama.cpp so far: what the tests hold it to

    # -- TargetBackend --------------------------------------------------------------------------

    def forward(self, tokens, positions, mask: Optional[np.ndarray] = None, taps: Sequence[str] = (),
                all_logits: bool = True) -> ForwardResult:
        """TargetBackend.forward; `all_logits` False (a prefill's chunks) returns the logits of the last token
        only, (1, V), and llama.cpp computes no others (with a tap asked, every row is still output)."""
        last_logits_only = not all_logits
        tokens = np.asarray(tokens, np.int64)
        positions = np.asarray(positions, np.int64)
        t = tokens.shape[0]
        self.cache.check_room(t)
        for name in taps:
            if name not in self.tap_names:
                raise BackendError(f"tap {name!r} was not requested when the gguf backend was opened "
                                   f"(it has {list(self.tap_names)})")
        p = self.cache.length
        if t == 1 and mask is None and not self.tree.pos:  # a plain step: the one-row case of the chain below
            chain = int(positions[0]) == p
        else:
            causal = mask is None or (not self.tree.pos and bool(mask[:, :p].all())
                                      and np.array_equal(mask[:, p:], np.tri(t, dtype=bool)))
            chain = causal and not self.tree.pos and np.array_equal(positions, np.arange(p, p + t))
        if chain:
            # Extends the committed chain (a prefill, plain decoding): sequence 0, in batches of max_batch.
            outs = [self._decode(tokens[s:s + self.max_batch], positions[s:s + self.max_batch], None, None, taps,
                                 last_logits_only) for s in range(0, t, self.max_batch)]
            self.committed += t
            self.cache.length = p + t
            one = len(outs) == 1  # a step or a prompt within one batch: no second copy
            logits = outs[-1][0][-1:] if last_logits_only else outs[0][0] if one else np.concatenate([o[0] for o in outs])
            return ForwardResult(logits=logits, taps={n: outs[0][1][n] if one else np.concatenate([o[1][n] for o in outs])
                                                      for n in taps})
        if mask is None:
            mask = np.concatenate([np.ones((t, p), bool), np.tri(t, dtype=bool)], axis=1)
        if mask.shape != (t, p + t):
            raise ValueError(f"mask shape {mask.shape}, expected {(t, p + t)} (new tokens x cache+new)")
        if t > self.max_batch:
            raise BackendError(f"llama.cpp backend: a {t}-token tree forward exceeds its batch of {self.max_batch}")
        query, seqs, fresh = assign_sequences(positions, mask, self.committed, self.tree)
        for s in fresh:  # a new branch sees the committed rows: add it to their cells (no K/V copied)
            if self.committed:
                self.lib.llama_memory_seq_cp(self.mem, 0, s, 0, self.committed)
            self.tree.used.add(s)
        logits, got = self._decode(tokens, positions, query, seqs, taps, last_logits_only)
        logits = logits[-1:] if last_logits_only else logits
        self.tree.pos += positions.tolist()
        self.tree.seqs += seqs
        self.cache.length = p + t
        return ForwardResult(logits=logits, taps=got)

    def _decode(self, tokens, positions, query, seqs, taps, last_only: bool = False):
        """One llama_decode of T tokens from the preallocated batch. `seqs` None: a chain in sequence 0. Logits
        (and taps) of every row, or of the last row alone when `last_only` and no tap is asked: llama.cpp then
        runs its LM head on that row only and one (1, V) row is copied out."""
        lib, b, t = self.lib, self.batch, len(tokens)
        b.n_tokens = t
        self._token[:t] = tokens
        self._pos[:t] = positions
        if seqs is None:
            self._n_seq[:t] = 1
            if self._tree_rows:  # rows a tree batch left on another sequence go back to sequence 0
                for i in np.flatnonzero(self._first_seq != 0):
                    b.seq_id[i][0] = 0
                self._first_seq[:] = 0
                self._tree_rows = False
        else:
            for i in range(t):  # a tree: T <= a few dozen rows, each with its own set of sequences
                ids = [query[i]] + sorted(seqs[i] - {query[i]})
                b.n_seq_id[i] = len(ids)
                for j, s in enumerate(ids):
                    b.seq_id[i][j] = s
            self._first_seq[:t] = query
            self._tree_rows = True
        out = self._wants[:t]
        one_row = last_only and not taps
        out[:] = 0 if one_row else 1
        out[t - 1] = 1
        rc = lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise BackendError(f"llama.cpp decode failed (code {rc}) for {t} tokens at positions "
                               f"{int(positions[0])}..{int(positions[-1])}{_recent_log()}")
        rows = 1 if one_row else t  # the rows `out` asks llama.cpp for
        self.logit_rows_fetched += rows
        logits = self._rows(lib.llama_get_logits(self.ctx), rows, self.spec.vocab_size).copy()  # (rows, V)
        got = {}
        if "final_norm" in taps:
            got["final_norm"] = self._rows(lib.llama_get_embeddings(self.ctx), rows, self.spec.hidden_size).copy()
        return logits, got

    def _rows(self, ptr, rows: int, width: int) -> np.ndarray:
        """The first `rows` x `width` floats at a llama.cpp output pointer. np.ctypeslib.as_array makes a ctypes
        array type per call (~0.2 ms, measured); the buffer stays put between decodes, so one view per address
        (never read past the `rows` llama.cpp wrote) is made once and sliced."""
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        view = self._views.get((addr, width))
        if view is None:
            view = np.ctypeslib.as_array(ptr, shape=(self.max_batch, width))
            self._views = {(addr, width): view, **{k: v for k, v in self._views.items() if k[1] != width}}
        return view[:rows]

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """KVCache.keep's contract. Rows already in place extend `start`; the kept rows past the committed
        prefix must be one path with positions in row order (what the engine and drafters keep). That path
        becomes sequence 0 (bookkeeping, no K/V moved) and everything else is dropped."""
        rows = list(rows)
        length, c = self.cache.length, self.committed
        if start > length or any(r < start or r >= length for r in rows):
            raise ValueError(f"keep({start}, {rows}) outside the {length} valid rows of '{self.cache.name}'")
        while rows and rows[0] == start:  # already where it belongs
            start += 1
            rows.pop(0)
        lib, mem = self.lib, self.mem
        if start == length == c and not self.tree.pos:  # plain decoding's keep: nothing past the chain to drop
            return
        if start < c and rows:
            raise BackendError(f"llama.cpp backend: keep would move rows {rows} into the committed prefix at {start}")
        if start <= c and not rows:
            lib.llama_memory_seq_rm(mem, -1, start, -1)
            self._drop_branches()
            self.committed = self.cache.length = start
            return
        kept = list(range(c, start)) + rows
        idx = [r - c for r in kept]
        pos = [self.tree.pos[i] for i in idx]
        if pos != list(range(c, c + len(kept))):
            raise BackendError(f"llama.cpp backend: kept rows {kept} have positions {pos}, not {c}.. in order")
        common = frozenset.intersection(*[self.tree.seqs[i] for i in idx])
        if not common:
            raise BackendError(f"llama.cpp backend: kept rows {kept} are not one branch of the tree")
        s = 0 if 0 in common else min(common)
        end = c + len(kept)
        if s != 0:  # the path lives in branch s: make it sequence 0
            lib.llama_memory_seq_rm(mem, 0, c, -1)
            lib.llama_memory_seq_cp(mem, s, 0, c, end)
        lib.llama_memory_seq_rm(mem, 0, end, -1)
        self._drop_branches()
        self.committed = self.cache.length = end

    def _drop_branches(self) -> None:
        for s in self.tree.used - {0}:
            self.lib.llama_memory_seq_rm(self.mem, s, -1, -1)
        self.tree = _TreeRows()

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)
        self.tree = _TreeRows()
        self.committed = 0
        self.cache.reset()

    # -- lifetime -------------------------------------------------------------------------------

    def _free_model(self) -> None:
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "pool", None):  # after the context that used it
            _threadpool_api()[1](self.pool)
            self.pool = None
        self._free_model()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
