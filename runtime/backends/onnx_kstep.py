"""A draft model's K-step graph on ONNX Runtime: K drafted tokens, their q rows and their K/V rows from ONE run.

The graph (contract: export/onnx/kstep.py) runs the draft model on the rows its cache lacks, then K times
processes the logits as runtime.sampling.process_logits does, draws a token by inverse CDF from a caller-supplied
uniform and runs that token. Its K/V are bound exactly as OnnxTarget binds the draft's step graph (the module
docstring of runtime/backends/onnx.py): layer i's past is rows [0, P) of its layer-major block, by pointer, and
its new rows land at [P, P+T+K-1) of the same block, so the arena rows are written in place, host or device.

    kstep = OnnxKStep(draft_target, "bundle/onnx/drafter.draft_model.kstep4.fp32.onnx", steps=4)
    tokens, q, confidence = kstep.run(ids, positions, params, history, rng.random(4))  # (K,), (K, V), (K,)

Only layer-major (matmul attention) draft graphs have one; a request the graph cannot express (a grammar, a tree:
runtime/drafters/draft_model.py's `_kstep_fits`) runs the step-wise path. `confidence` is each token's own
confidence (export/onnx/kstep.py's `confidence`), or None from a graph exported before it had that output."""
from __future__ import annotations

import time
from typing import NamedTuple, Optional, Sequence

import numpy as np

from runtime.backends.onnx import OnnxTarget, _binders
from runtime.backends.onnx_net import import_ort, open_session
from runtime.errors import BackendError
from runtime.sampling import SamplingParams

PARAM_INPUTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "logit_mask", "seen", "uniforms")


def param_feeds(params: SamplingParams, history: Sequence[int], vocab: int) -> dict:
    """The graph's processing inputs for one request (uniforms excluded).

    Example: temperature 0.7, allowed_tokens (1, 3), vocab 4 -> logit_mask (-inf, 0, -inf, 0)."""
    mask = np.zeros(vocab, np.float32)
    if params.allowed_tokens is not None:
        mask[:] = -np.inf
        mask[np.asarray(params.allowed_tokens, np.int64)] = 0.0
    seen = np.zeros(vocab, np.bool_)
    if params.repetition_penalty != 1.0 and len(history):
        h = np.asarray(history, np.int64)
        seen[h[(h >= 0) & (h < vocab)]] = True
    return {"temperature": np.array([params.temperature], np.float32), "top_k": np.array([params.top_k], np.int64),
            "top_p": np.array([params.top_p], np.float32), "min_p": np.array([params.min_p], np.float32),
            "repetition_penalty": np.array([params.repetition_penalty], np.float32), "logit_mask": mask, "seen": seen}


def uniforms_dtype(session) -> type:
    """The dtype a K-step graph takes its uniforms in: float64 (the draw sums its mass in float64,
    export/onnx/kstep.py's `draw`), float32 from a graph exported before (its draw is then float32's, and so is
    its small error: re-export the bundle's ONNX graphs to remove it)."""
    got = next(i.type for i in session.get_inputs() if i.name == "uniforms")
    return np.float64 if got == "tensor(double)" else np.float32


class KStepChain(NamedTuple):
    tokens: np.ndarray  # (K,) int64: the drafted chain
    q: np.ndarray  # (K, V) float32: the distribution each was drawn from
    confidence: Optional[np.ndarray]  # (K,) float32: each token's own confidence; None: the graph has no such output


class OnnxKStep:
    """The K-step graph of the draft model run by `target` (an OnnxTarget with a layer-major arena)."""

    def __init__(self, target: OnnxTarget, model_path: str, steps: int,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 0, spinning: str = "never"):
        if target.shared_kv:
            raise BackendError(f"{model_path}: a K-step graph needs the draft's layer-major K/V; its step graph "
                               "uses GroupQueryAttention (re-export with the default attention)")
        ort = import_ort()
        self.target, self.steps, self.model_path = target, int(steps), model_path
        self.session = open_session(model_path, providers, threads, spinning=spinning)
        names = {i.name for i in self.session.get_inputs()}
        missing = [n for n in ("input_ids", *PARAM_INPUTS) if n not in names]
        if missing:
            raise BackendError(f"{model_path}: the K-step graph has no input {missing[0]!r}; re-export the bundle's "
                               "ONNX graphs with `edgespec export --to onnx --bundle DIR --kstep on`")
        self.has_confidence = "confidence" in {o.name for o in self.session.get_outputs()}
        self.uniforms_dtype = uniforms_dtype(self.session)
        self.binding = self.session.io_binding()
        self._bind_input, self._bind_output = _binders(ort, self.binding)
        self._bind_kv_in, self._bind_kv_out = _binders(ort, self.binding, target.device)
        n = target.spec.num_layers
        if target.device_arena is not None:
            self._blocks = [target.device_arena.addresses(i, 0)[:2] for i in range(n)]
        else:
            self._blocks = [(target.k[i].ctypes.data, target.v[i].ctypes.data) for i in range(n)]
        self.last_run_s = 0.0

    def _bind_in(self, name: str, arr: np.ndarray) -> None:
        self._bind_input(name, arr.dtype, arr.shape, arr.ctypes.data)

    def run(self, tokens, positions, params: SamplingParams, history: Sequence[int],
            uniforms: np.ndarray) -> KStepChain:
        """Run the T rows `tokens` the draft cache lacks and draft K tokens after them -> KStepChain; the cache
        grows by T + K - 1 rows (the K-th token is not run)."""
        tg = self.target
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        t, p, k = tokens.shape[0], tg.cache.length, self.steps
        tg.cache.check_room(t + k - 1)
        feeds = param_feeds(params, history, tg.spec.vocab_size)
        feeds["uniforms"] = np.ascontiguousarray(uniforms, dtype=self.uniforms_dtype)
        out_tokens = np.empty(k, np.int64)
        q = np.empty((k, tg.spec.vocab_size), np.float32)
        b = self.binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        self._bind_in("input_ids", tokens)
        self._bind_in("position_ids", positions)
        for name, arr in feeds.items():
            self._bind_in(name, arr)
        past, new, dt = (p, *tg._row), (t + k - 1, *tg._row), tg.kv_dtype
        skip = p * tg._row_bytes
        for i, (kp, vp) in enumerate(self._blocks):
            self._bind_kv_in(f"past_key_{i}", dt, past, kp)
            self._bind_kv_in(f"past_value_{i}", dt, past, vp)
            self._bind_kv_out(f"new_key_{i}", dt, new, kp + skip)
            self._bind_kv_out(f"new_value_{i}", dt, new, vp + skip)
        self._bind_output("tokens", out_tokens.dtype, out_tokens.shape, out_tokens.ctypes.data)
        self._bind_output("q", q.dtype, q.shape, q.ctypes.data)
        conf = np.empty(k, np.float32) if self.has_confidence else None
        if conf is not None:
            self._bind_output("confidence", conf.dtype, conf.shape, conf.ctypes.data)
        start = time.perf_counter()
        self.session.run_with_iobinding(b)
        self.last_run_s = time.perf_counter() - start
        tg.cache.length = p + t + k - 1
        return KStepChain(out_tokens, q, conf)
