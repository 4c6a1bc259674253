"""Held-out evaluation during training: per-depth acceptance, the expected tokens per cycle of the drafter's chain,
the curve of them written beside the checkpoint, and the rule --until-plateau stops by."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

import numpy as np
import torch


def evaluate(task, batches: Sequence) -> Dict[str, object]:
    """Held-out numbers of `task`: its loss, the per-depth acceptance a_d (hits / count at depth d, the path
    above right) and the expected tokens per cycle of its chain, tau = 1 + sum_d prod_{i<=d} a_i (greedy,
    depths independent). Example: a = [0.8, 0.5] -> tau = 1 + 0.8 + 0.4 = 2.2."""
    hits: List[float] = []
    count: List[float] = []
    loss = 0.0
    was = task.training
    task.eval()
    with torch.no_grad():
        for b in batches:
            loss += float(task(b)[0])
            for d, (h, n) in enumerate(task.tally):
                if d == len(hits):
                    hits.append(0.0)
                    count.append(0.0)
                hits[d] += float(h)
                count[d] += float(n)
    task.train(was)
    acc = [h / n if n else 0.0 for h, n in zip(hits, count)]
    return {"loss": loss / max(len(batches), 1), "per_depth": acc, "tau": 1.0 + float(np.cumprod(acc).sum())}


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
                                   "held-out acceptance a_d (teacher-forced, greedy)",
           "rule": f"until_plateau={cfg.until_plateau}: stop when {cfg.patience} evaluations in a row fail to beat "
                   f"the best earlier tau by more than {cfg.min_gain:.1%}", "points": curve}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
