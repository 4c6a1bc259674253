"""An EAGLE head's K-step chain graph: the catch-up rows, K draft steps, the logits processing and the sampling in
ONE ONNX Runtime run (export/onnx/kstep.py is the draft model's; both process and draw with its torch functions).

A step-wise EAGLE chain costs one run of the head's step graph (export/drafters/eagle_onnx.py) per drafted token
plus the numpy processing between them; on a GPU each is a launch and a host round trip. This graph unrolls K
steps of the same layer: step 0 runs the rows the head's cache lacks (feature f_t, token x_{t+1}; the last row is
the root's), each later step runs the token just drawn on the layer's own output h' of the row before, one
position on, attending to the past and every new row.

Graph contract (bundle: the head's backends.onnx entry, params kstep_graph / kstep_steps):
  inputs   input_ids          int64   (T,)        x_{t+1} of each catch-up row
           features           float32 (T, H)      their features (EAGLE-3: already fused by fc, as for the step graph)
           position_ids       int64   (T,)        consecutive
           temperature, top_k, top_p, min_p, repetition_penalty, logit_mask, seen, uniforms
                                                  as export/onnx/kstep.py's (logit_mask / seen over the TARGET's V)
           past_key           float32 (P, nkv, d) the head's own cache rows
           past_value         float32 (P, nkv, d)
  outputs  tokens             int64   (K,)        the drafted chain (target ids)
           q                  float32 (K, V)      the processed distribution over the target's vocabulary each token
                                                  was drawn from (EAGLE-3: ids outside its draft vocabulary get 0)
           confidence         float32 (K,)        each token's own confidence (export/onnx/kstep.py's `confidence`)
           new_key            float32 (T+K-1, nkv, d) the catch-up rows and the first K-1 drafted tokens' rows
           new_value          float32 (T+K-1, nkv, d)"""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np
import torch

from export.drafters.eagle_onnx import EagleStepGraph
from export.library_logs import quiet_library
from export.onnx.graph import OPSET, save_program
from export.onnx.kstep import PARAM_INPUTS, confidence, draw, penalise, processed
from runtime.drafters.base import DraftContext
from runtime.drafters.eagle import UNMAPPED, EagleDrafter
from runtime.errors import ExportError
from runtime.sampling import SamplingParams

INPUTS = ("input_ids", "features", "position_ids", *PARAM_INPUTS, "past_key", "past_value")
OUTPUTS = ("tokens", "q", "confidence", "new_key", "new_value")
TOLERANCE = 1e-4  # max |graph - numpy| of q rows and confidences (the step graph's tolerance)


class KStepEagleGraph(torch.nn.Module):
    """K steps of an EAGLE head's layer with processing and sampling between them (see the module docstring)."""

    def __init__(self, drafter: EagleDrafter, steps: int):
        super().__init__()
        self.step = EagleStepGraph(drafter)
        self.steps, self.vocab = steps, drafter.vocab
        ids = drafter.draft_ids
        self.mapped = ids is not None
        self.unmapped = float(UNMAPPED)  # a Python float: the tracer does not take a numpy scalar
        if self.mapped:  # EAGLE-3 with a reduced vocabulary: head row i is target id ids[i]
            self.register_buffer("draft_ids", torch.from_numpy(np.asarray(ids, np.int64)), persistent=False)

    def _target_logits(self, head_row):
        """(V',) head logits of one row -> (V,) over the target's vocabulary (UNMAPPED where it has no row)."""
        if not self.mapped:
            return head_row
        return torch.full((self.vocab,), self.unmapped).scatter(0, self.draft_ids, head_row)

    def forward(self, input_ids, features, position_ids, temperature, top_k, top_p, min_p, repetition_penalty,
                logit_mask, seen, uniforms, past_key, past_value):
        t = input_ids.shape[0]
        p = past_key.shape[0]
        causal = torch.cat([torch.zeros(t, p), torch.triu(torch.full((t, t), float("-inf")), diagonal=1)], dim=-1)
        logits, hidden, new_k, new_v = self.step(input_ids, features, position_ids, causal, past_key, past_value)
        head_row, h = logits[-1], hidden[-1:]
        pos = position_ids[-1:]
        tokens, qs, confs = [], [], []
        for j in range(self.steps):
            x = penalise(self._target_logits(head_row).float(), repetition_penalty, logit_mask, seen)
            q = processed(x, temperature, top_k, top_p, min_p)
            tok = draw(q, uniforms[j:j + 1]).reshape(1)
            tokens.append(tok)
            qs.append(q)
            confs.append(confidence(x, q, tok, temperature))
            if j + 1 == self.steps:
                break
            seen = seen | (torch.arange(seen.shape[0]) == tok)
            pos = pos + 1
            # one new row on the layer's own output: it sees the past and every new row
            n = new_k.shape[0]
            logits, h, k, v = self.step(tok, h, pos, torch.zeros(1, p + n + 1), torch.cat([past_key, new_k]),
                                        torch.cat([past_value, new_v]))
            head_row = logits[-1]
            new_k, new_v = torch.cat([new_k, k]), torch.cat([new_v, v])
        return torch.cat(tokens), torch.stack(qs), torch.cat(confs), new_k, new_v


def export_eagle_kstep(drafter: EagleDrafter, out_path: str, steps: int) -> str:
    """Write the head's K-step graph to `out_path` (+ .data); returns out_path."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    module = KStepEagleGraph(drafter, steps).eval()
    s = drafter.spec
    t, p, v = 3, 5, drafter.vocab
    kv = (p, s.num_kv_heads, s.head_dim)
    args = (torch.zeros(t, dtype=torch.int64), torch.zeros(t, s.hidden_size), torch.arange(p, p + t), torch.ones(1),
            torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1), torch.ones(1), torch.zeros(v),
            torch.zeros(v, dtype=torch.bool), torch.full((steps,), 0.5), torch.zeros(kv), torch.zeros(kv))
    T, P = torch.export.Dim("T"), torch.export.Dim("P")
    dynamic = {"input_ids": {0: T}, "features": {0: T}, "position_ids": {0: T}, "temperature": None, "top_k": None,
               "top_p": None, "min_p": None, "repetition_penalty": None, "logit_mask": None, "seen": None,
               "uniforms": None, "past_key": {0: P}, "past_value": {0: P}}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():
        # strict tracing at once, as export/onnx/kstep.py: torch.cond is not traced otherwise
        exported = torch.export.export(module, args, dynamic_shapes=dynamic, strict=True)
        program = torch.onnx.export(exported, dynamo=True, opset_version=OPSET, input_names=list(INPUTS),
                                    output_names=list(OUTPUTS), verbose=False)
    return save_program(program, out_path)


def compare_with_numpy(drafter: EagleDrafter, path: str, steps: int, seed: int = 0) -> float:
    """Max |graph - numpy| of the q rows and confidences of one K-step run against the numpy drafter's step-wise
    chain on the same draws (its cache reset; a 9-token context, random features), at temperature 1 without
    truncation (q is then the plain softmax, the most sensitive to the logits) and greedy (the confidences)."""
    from runtime.drafters.heads import HeadKStep

    rng = np.random.default_rng(seed)
    v, h = drafter.vocab, drafter.spec.hidden_size
    context = [int(x) for x in rng.integers(0, v, 9)]
    feats = rng.standard_normal((len(context) - 1, h)).astype(np.float32) * 0.5
    ks = HeadKStep(path, steps)
    worst = 0.0
    for params in (SamplingParams(temperature=1.0), SamplingParams()):
        u = rng.random(steps) if not params.greedy else np.zeros(steps)
        drafter.reset()
        drafter.pending = feats
        got = ks.run(drafter.cache, context[1:], feats, np.arange(len(context) - 1), params, context, u)
        drafter.reset()
        drafter.pending = feats
        # the numpy step-wise CHAIN (the head may be built for a user with a dynamic tree: eagle2, eagle3)
        saved = drafter.k, drafter.kstep, drafter.tree, drafter.branching
        drafter.k, drafter.kstep, drafter.tree, drafter.branching = steps, None, None, 1
        try:
            want = drafter.propose(DraftContext(context, params, _Replay(u), steps, record_confidence=True))
        finally:
            drafter.k, drafter.kstep, drafter.tree, drafter.branching = saved
        if len(want) != steps or not np.array_equal(got.tokens, want.tokens):
            raise ExportError(f"{path}: the K-step graph drafted {got.tokens.tolist()}, the numpy drafter "
                              f"{want.tokens.tolist()} on the same draws")
        own = want.confidence / np.concatenate([[1.0], want.confidence[:-1]])
        worst = max(worst, float(np.max(np.abs(got.confidence - own))))
        if not params.greedy:
            worst = max(worst, float(np.max(np.abs(got.q - want.q))))
    drafter.reset()
    return worst


class _Replay:
    """A stand-in for the drafter's generator that hands out the given uniforms in order (the step-wise chain's
    draws then take the K-step graph's)."""

    def __init__(self, uniforms: np.ndarray):
        self.u = list(uniforms)

    def random(self, size=None):
        return self.u.pop(0) if size is None else np.asarray([self.u.pop(0) for _ in range(size)])


def export_and_check(drafter: EagleDrafter, out_path: str, steps: int, label: str, validate: bool = True) -> str:
    """Export, then compare with the numpy drafter; ExportError (naming the graph and the error) over TOLERANCE."""
    export_eagle_kstep(drafter, out_path, steps)
    if validate:
        err = compare_with_numpy(drafter, out_path, steps)
        print(f"{label}: max |onnx - numpy| of q and confidences {err:.2e} (allowed {TOLERANCE:.0e})")
        if not err <= TOLERANCE:
            raise ExportError(f"{label}: the EAGLE K-step graph differs from the numpy drafter by {err:.2e} (> "
                              f"{TOLERANCE:.0e}); the bundle was left unchanged (`--no-validate` writes the graphs anyway)")
    return out_path


def kstep_params(steps: int, rel: str) -> Mapping:
    return {"kstep_graph": rel, "kstep_steps": int(steps)}
