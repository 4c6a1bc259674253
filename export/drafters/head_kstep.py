"""A drafter head's K-step chain graph: the catch-up rows, K draft steps, the logits processing and the sampling in
ONE ONNX Runtime run, for the heads that chain on their own output (an EAGLE-1/3 head, a single MTP module). The
draft model's is export/onnx/kstep.py; all of them process and draw with its torch functions.

A step-wise chain costs one run of the head's step graph per drafted token plus the numpy processing between them;
on a GPU each is a launch and a host round trip. This graph unrolls K steps of the same layer: step 0 runs the
rows the head's cache lacks (feature f_t, token x_{t+1}; the last row is the root's), each later step runs the
token just drawn on the layer's own output h of the row before, one position on, attending to the past and every
new row. A head supplies its step (`KStepHeadGraph.step`); the export and the check are here, once, and the loop
(`unroll`) is export/onnx/kstep.py's, the draft model's too.

Graph contract (bundle: the drafter's backends.onnx entry, params kstep_graph / kstep_steps):
  inputs   input_ids          int64   (T,)        x_{t+1} of each catch-up row
           features           float   (T, H)      their features (EAGLE-3: already fused by fc; MTP: the target's
                                                  last-layer output), as for the head's step graph
           position_ids       int64   (T,)        consecutive
           temperature, top_k, top_p, min_p, repetition_penalty, logit_mask, seen, uniforms
                                                  as export/onnx/kstep.py's (logit_mask / seen over the TARGET's V)
           past_key           kv      (P, nkv, d) the head's own cache rows
           past_value         kv      (P, nkv, d)
  outputs  tokens             int64   (K,)        the drafted chain (target ids)
           q                  float32 (K, V)      the processed distribution each token was drawn from
           confidence         float32 (K,)        each token's own confidence (export/onnx/kstep.py's `confidence`)
           new_key            kv      (T+K-1, nkv, d) the catch-up rows and the first K-1 drafted tokens' rows
           new_value          kv      (T+K-1, nkv, d)"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch

from export.library_logs import quiet_library
from export.onnx.graph import OPSET, PRECISIONS, graph_weight_bytes, save_program
from export.onnx.kstep import PARAM_INPUTS, unroll
from runtime.drafters.base import DraftContext
from runtime.errors import ExportError
from runtime.sampling import SamplingParams

INPUTS = ("input_ids", "features", "position_ids", *PARAM_INPUTS, "past_key", "past_value")
OUTPUTS = ("tokens", "q", "confidence", "new_key", "new_value")


class KStepHeadGraph(torch.nn.Module):
    """K steps of a head's layer with processing and sampling between them (see the module docstring)."""

    def __init__(self, steps: int, vocab: int):
        super().__init__()
        self.steps, self.vocab = steps, vocab

    def step(self, input_ids, features, position_ids, attention_mask, past_key, past_value):
        """The head's step graph on T rows -> (the last row's logits over the TARGET's vocabulary (V,) float32,
        the layer's outputs (T, H) fed to the next step, new K (T, nkv, d), new V)."""
        raise NotImplementedError

    def forward(self, input_ids, features, position_ids, temperature, top_k, top_p, min_p, repetition_penalty,
                logit_mask, seen, uniforms, past_key, past_value):
        t = input_ids.shape[0]
        p = past_key.shape[0]
        causal = torch.cat([torch.zeros(t, p), torch.triu(torch.full((t, t), float("-inf")), diagonal=1)], dim=-1)
        logits, hidden, new_k, new_v = self.step(input_ids, features, position_ids, causal, past_key, past_value)
        state = {"h": hidden[-1:], "k": new_k, "v": new_v}  # the last row's output and the new K/V rows so far

        def advance(tok, pos):  # one new row on the layer's own output: it sees the past and every new row
            k0, v0 = state["k"], state["v"]
            out, h, k, v = self.step(tok, state["h"], pos, torch.zeros(1, p + k0.shape[0] + 1), torch.cat([past_key, k0]),
                                     torch.cat([past_value, v0]))
            state.update(h=h[-1:], k=torch.cat([k0, k]), v=torch.cat([v0, v]))
            return out

        processing = (temperature, top_k, top_p, min_p, repetition_penalty, logit_mask)
        chain = unroll(logits, position_ids[-1:], self.steps, uniforms, processing, seen, advance)
        return (*chain, state["k"], state["v"])


def export_kstep(module: KStepHeadGraph, out_path: str, hidden: int, kv_shape, precision: str = "fp32") -> str:
    """Write `module` (a KStepHeadGraph) to `out_path` (+ .data); kv_shape (nkv, d) of the head's cache rows."""
    dt = PRECISIONS[precision]
    t, p, v, k = 3, 5, module.vocab, module.steps
    kv = (p, *kv_shape)
    args = (torch.zeros(t, dtype=torch.int64), torch.zeros(t, hidden, dtype=dt), torch.arange(p, p + t), torch.ones(1),
            torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1), torch.ones(1), torch.zeros(v),
            torch.zeros(v, dtype=torch.bool), torch.full((k,), 0.5, dtype=torch.float64), torch.zeros(kv, dtype=dt), torch.zeros(kv, dtype=dt))
    T, P = torch.export.Dim("T"), torch.export.Dim("P")
    dynamic = {"input_ids": {0: T}, "features": {0: T}, "position_ids": {0: T}, "temperature": None, "top_k": None,
               "top_p": None, "min_p": None, "repetition_penalty": None, "logit_mask": None, "seen": None,
               "uniforms": None, "past_key": {0: P}, "past_value": {0: P}}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():
        # strict tracing at once, as export/onnx/kstep.py: torch.cond is not traced otherwise
        exported = torch.export.export(module.eval(), args, dynamic_shapes=dynamic, strict=True)
        program = torch.onnx.export(exported, dynamo=True, opset_version=OPSET, input_names=list(INPUTS),
                                    output_names=list(OUTPUTS), verbose=False)
    return save_program(program, out_path)


class Replay:
    """A drafter's generator replaced by given uniforms, handed out in order: a step-wise chain then draws what the
    K-step graph drew from the same uniforms."""

    def __init__(self, uniforms):
        self.u = list(uniforms)

    def random(self, size=None):
        return self.u.pop(0) if size is None else np.asarray([self.u.pop(0) for _ in range(size)])


def compare_with_stepwise(path: str, steps: int, vocab: int, run_kstep: Callable, stepwise: Callable,
                          seed: int = 0) -> float:
    """Max |graph - step-wise| of the q rows and confidences of one K-step run against the drafter's numpy step-wise
    chain on the same draws, at temperature 1 without truncation (q is then the plain softmax, the most sensitive to
    the logits) and greedy (the confidences). `run_kstep(context, params, u)` -> KStepChain from a fresh cache;
    `stepwise(context, ctx)` -> the step-wise DraftTree from the same state. ExportError if the tokens differ."""
    rng = np.random.default_rng(seed)
    context = [int(x) for x in rng.integers(0, vocab, 9)]
    worst = 0.0
    for params in (SamplingParams(temperature=1.0), SamplingParams()):
        u = rng.random(steps) if not params.greedy else np.zeros(steps)
        got = run_kstep(context, params, u)
        want = stepwise(context, DraftContext(context, params, Replay(u), steps, record_confidence=True))
        if len(want) != steps or not np.array_equal(got.tokens, want.tokens):
            raise ExportError(f"{path}: the K-step graph drafted {got.tokens.tolist()}, the numpy drafter "
                              f"{want.tokens.tolist()} on the same draws")
        own = want.confidence / np.concatenate([[1.0], want.confidence[:-1]])
        worst = max(worst, float(np.max(np.abs(got.confidence - own))))
        if not params.greedy:
            worst = max(worst, float(np.max(np.abs(got.q - want.q))))
    return worst


def check(label: str, err: float, tolerance: float) -> None:
    print(f"{label}: max |onnx - numpy| of q and confidences {err:.2e} (allowed {tolerance:.0e})")
    if not err <= tolerance:
        raise ExportError(f"{label}: the K-step graph differs from the numpy drafter by {err:.2e} (> {tolerance:.0e});"
                          " the bundle was left unchanged (`--no-validate` writes the graphs anyway)")


def kstep_params(steps: int, rel: str, staged: str) -> dict:
    """The onnx entry's record of the K-step graph at bundle path `rel` (written, its data shared, at `staged`)."""
    return {"kstep_graph": rel, "kstep_steps": int(steps), "kstep_weight_bytes": graph_weight_bytes(staged)}
