"""An EAGLE-1/3 head's K-step chain graph (the contract, the loop and the check: export/drafters/head_kstep.py): its
step is the head's step graph (export/drafters/eagle_onnx.py), its logits placed over the target's vocabulary
(EAGLE-3 with a reduced draft vocabulary: by d2t, UNMAPPED elsewhere, as runtime/drafters/eagle.py does)."""
from __future__ import annotations

import numpy as np
import torch

from export.drafters import head_kstep
from export.drafters.eagle_onnx import EagleStepGraph
from runtime.drafters.eagle import UNMAPPED, EagleDrafter

TOLERANCE = 1e-4  # max |graph - numpy| of q rows and confidences (the step graph's tolerance)


class KStepEagleGraph(head_kstep.KStepHeadGraph):
    def __init__(self, drafter: EagleDrafter, steps: int):
        super().__init__(steps, drafter.vocab)
        self.head = EagleStepGraph(drafter)
        ids = drafter.draft_ids
        self.mapped = ids is not None
        self.unmapped = float(UNMAPPED)  # a Python float: the tracer does not take a numpy scalar
        if self.mapped:  # EAGLE-3 with a reduced vocabulary: head row i is target id ids[i]
            self.register_buffer("draft_ids", torch.from_numpy(np.asarray(ids, np.int64)), persistent=False)

    def step(self, input_ids, features, position_ids, attention_mask, past_key, past_value):
        logits, hidden, k, v = self.head(input_ids, features, position_ids, attention_mask, past_key, past_value,
                                         last_only=True)  # the catch-up's other rows need no logits
        row = logits[0].float()
        if self.mapped:
            row = torch.full((self.vocab,), self.unmapped).scatter(0, self.draft_ids, row)
        return row, hidden, k, v


def export_and_check(drafter: EagleDrafter, out_path: str, steps: int, label: str, validate: bool = True) -> str:
    """Export the head's K-step graph, then compare it with the numpy drafter's step-wise CHAIN (the head may be
    built for a user with a dynamic tree: eagle2, eagle3); ExportError over TOLERANCE."""
    from runtime.drafters.heads import HeadKStep

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    s = drafter.spec
    head_kstep.export_kstep(KStepEagleGraph(drafter, steps), out_path, s.hidden_size, (s.num_kv_heads, s.head_dim))
    if not validate:
        return out_path
    ks = HeadKStep(out_path, steps)
    feats = (0.5 * np.random.default_rng(1).standard_normal((8, s.hidden_size))).astype(np.float32)

    def run_kstep(context, params, u):
        drafter.reset()
        return ks.run(drafter.cache, context[1:], feats, np.arange(len(context) - 1), params, context, u)

    def stepwise(context, ctx):
        saved = drafter.k, drafter.kstep, drafter.tree, drafter.branching
        drafter.k, drafter.kstep, drafter.tree, drafter.branching = ctx.max_nodes, None, None, 1
        try:
            drafter.reset()
            drafter.pending = feats
            return drafter.propose(ctx)
        finally:
            drafter.k, drafter.kstep, drafter.tree, drafter.branching = saved

    try:
        err = head_kstep.compare_with_stepwise(out_path, steps, drafter.vocab, run_kstep, stepwise)
    finally:
        drafter.reset()
    head_kstep.check(label, err, TOLERANCE)
    return out_path
