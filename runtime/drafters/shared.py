"""Drafting pieces every tree-building drafter shares, so that no drafter imports another: how the children
of one node are picked (greedy top-k ranked at temperature 1, or sampled through the sibling rule)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import numpy as np

from runtime.sampling import SamplingParams, process_logits
from runtime.siblings import Siblings, draw_siblings, top_k


def pick_children(logits: np.ndarray, q: np.ndarray, params: SamplingParams, history: Sequence[int],
                  width: int, rng: np.random.Generator, rule: Callable = draw_siblings,
                  mask: Optional[np.ndarray] = None) -> Siblings:
    """Children of one node. Greedy -> the top-`width` tokens as point masses; sampled -> `rule` (the one
    sibling rule of `runtime.siblings`: distinct draws, each with the proposal it was drawn from).
    `mask`: the grammar's allowed tokens at this node (q is already masked by it)."""
    if params.greedy:
        if width == 1:
            return Siblings(np.asarray([int(np.argmax(q))], np.int64), None)
        # q is one-hot under greedy; rank by the masked, penalised distribution at temperature 1.
        soft = process_logits(logits, replace(params, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), history, mask)
        return top_k(soft, width)
    return rule(q, width, rng)
