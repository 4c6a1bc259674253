"""export/training.py: the one learning-rate schedule and the one atomic checkpoint writer, shared by the zoo's
training (export/zoo/train.py) and every drafter's (export/drafters/trainer.py)."""
import os

import pytest
import torch

from export import training
from export.drafters import trainer
from export.zoo import train as zoo_train


def test_the_zoo_and_the_drafter_trainer_share_one_schedule_and_one_checkpoint_writer():
    assert zoo_train.lr_at is training.lr_at and trainer.lr_at is training.lr_at
    assert zoo_train.save_checkpoint is training.save_checkpoint is trainer.save_checkpoint


def test_the_schedule_warms_up_linearly_then_falls_by_cosine_to_a_tenth():
    assert training.lr_at(0, 0.0, 1e-3, 10) == pytest.approx(1e-4)  # step 1 of 10 warm-up steps
    assert training.lr_at(10, 0.0, 1e-3, 10) == pytest.approx(1e-3)
    assert training.lr_at(50, 0.5, 1e-3, 10) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert training.lr_at(99, 1.0, 1e-3, 10) == pytest.approx(1e-4)


def test_a_checkpoint_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    training.save_checkpoint(path, step=3)
    assert torch.load(path)["step"] == 3

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        training.save_checkpoint(path, step=4)
    assert torch.load(path)["step"] == 3 and os.listdir(tmp_path) == ["ckpt.pt"]  # the old one, no temporary left
