"""What every training loop on the export side shares (the zoo's target and draft, export/zoo/train.py; every
drafter kind, export/drafters/trainer.py): the learning-rate schedule and atomic checkpoints."""
from __future__ import annotations

import math
import os

import torch


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to peak/10 as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def save_checkpoint(path: str, **state) -> None:
    """torch.save to a temporary file beside `path`, then rename: a crash never leaves half a checkpoint."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
