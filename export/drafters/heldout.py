"""Held-out evaluation during training: per-depth acceptance, the expected tokens per cycle of the drafter's chain,
the curve of them written beside the checkpoint, and the rule --until-plateau stops by."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch


def evaluate(task, batches: Sequence) -> Dict[str, object]:
    """Held-out numbers of `task`: its loss, the per-depth acceptance a_d (hits / count at depth d, the path
    above right) and the expected tokens per cycle of its chain, tau = 1 + sum_d prod_{i<=d} a_i (greedy,
    depths independent); and the same at T = 1 (`per_depth_t1`, `tau_t1`: a_d = the mean of sum_x min(p, q), the
    chance a token drawn from the drafter is accepted), with an upper bound (`tau_t1_hi`) where the target was cut
    to its top k (`trainer.depth_tally`). Example: a = [0.8, 0.5] -> tau = 1 + 0.8 + 0.4 = 2.2."""
    sums: List[List[float]] = []  # per depth: greedy hits, count, sampled acceptance, its upper bound
    loss = 0.0
    was = task.training
    task.eval()
    with torch.no_grad():
        for b in batches:
            loss += float(task(b)[0])
            for d, numbers in enumerate(task.tally):
                if d == len(sums):
                    sums.append([0.0, 0.0, 0.0, 0.0])
                hits, n, lo, hi = (tuple(numbers) + (0.0, 0.0))[:4]
                for i, x in enumerate((hits, n, lo, hi)):
                    sums[d][i] += float(x)
    task.train(was)

    def tau(col: int) -> Tuple[List[float], float]:
        acc = [s[col] / s[1] if s[1] else 0.0 for s in sums]
        return acc, 1.0 + float(np.cumprod(acc).sum())

    (acc, greedy), (acc_t1, t1), (_, t1_hi) = tau(0), tau(2), tau(3)
    return {"loss": loss / max(len(batches), 1), "per_depth": acc, "tau": greedy, "per_depth_t1": acc_t1,
            "tau_t1": t1, "tau_t1_hi": t1_hi}


def plateaued(taus: Sequence[float], patience: int, min_gain: float) -> bool:
    """The stopping rule of --until-plateau: the last `patience` evaluations all failed to beat the best tau
    before them by more than min_gain of it. Example (patience 2, min_gain 0.01): 2.0, 2.5, 2.51, 2.52 -> True."""
    if len(taus) <= patience:
        return False
    best = max(taus[:-patience])
    return all(t <= best * (1 + min_gain) for t in taus[-patience:])


def write_curve(path: str, kind: str, cfg, curve: List[Dict[str, object]]) -> None:
    """The held-out curve as JSON (atomically): what --until-plateau decided on, to plot or compare runs."""
    doc = {"kind": kind, "metric": "expected tau of the chain, 1 + sum_d prod_{i<=d} a_i, from per-depth "
                                   "held-out acceptance a_d (teacher-forced, greedy); tau_t1 the same at T = 1 "
                                   "(a_d = mean sum_x min(p, q); tau_t1_hi its upper bound against a top-k target)",
           "rule": f"until_plateau={cfg.until_plateau}: stop when {cfg.patience} evaluations in a row fail to beat "
                   f"the best earlier tau by more than {cfg.min_gain:.1%}", "points": curve}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
