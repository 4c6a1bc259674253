"""The shared drafter trainer (export/drafters/trainer.py) on a tiny random zoo-style target with the Medusa
task: the loss falls, a run stopped and resumed from its checkpoint gives the same losses as one uninterrupted
run, and the task exports files the official-layout loader reads back."""
from tests.support import REPO_ROOT
import os

import numpy as np
import pytest

from runtime.errors import ConfigError
import torch

from export.drafters.medusa import medusa_task, read_medusa
from export.drafters.trainer import TrainConfig, train
from export.zoo.model import LlamaConfig, LlamaLM

CFG = TrainConfig(steps=6, budget_s=3600.0, lr=3e-3, warmup=1, batch=2, seq_len=32, seed=3, log_every=1, threads=1)


def tiny_target():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    return LlamaLM(cfg).eval()


def tiny_data():
    rng = np.random.default_rng(0)
    # a repetitive language, so that a few steps of distillation show
    base = rng.integers(3, 64, 12)
    make = lambda n: [np.roll(base, int(rng.integers(0, 12)))[: int(rng.integers(6, 12))].astype(np.int16)
                      for _ in range(n)]
    return {"planner_train": make(40), "action_train": make(20)}


def run(work, steps, resume=False, pause_at=None):
    target = tiny_target()
    torch.manual_seed(1)
    task = medusa_task(target, num_heads=2, num_layers=1)
    cfg = TrainConfig(**{**CFG.__dict__, "steps": steps})
    return task, train(task, target, tiny_data(), cfg, str(work), resume=resume, log=lambda _m: None,
                       pause_at=pause_at)


def test_distillation_lowers_the_loss_and_resume_continues_exactly(tmp_path):
    _, whole = run(tmp_path / "a", 6)
    assert whole.steps == 6 and whole.losses[-1] < whole.losses[0]
    _, first = run(tmp_path / "b", 6, pause_at=3)  # as if stopped after step 3
    assert first.steps == 3
    assert os.path.isfile(tmp_path / "b" / "ckpt.pt")
    assert not [n for n in os.listdir(tmp_path / "b") if n.endswith(".tmp")]  # written atomically
    task, rest = run(tmp_path / "b", 6, resume=True)
    assert rest.steps == 6
    assert np.allclose(first.losses + rest.losses, whole.losses, rtol=1e-5, atol=1e-6)


def test_a_resumed_run_with_other_settings_is_refused(tmp_path):
    run(tmp_path, 2)
    target = tiny_target()
    task = medusa_task(target, num_heads=2, num_layers=1)
    other = TrainConfig(**{**CFG.__dict__, "lr": 1e-2})
    with pytest.raises(ConfigError, match=r"checkpoint of another run \(lr 0\.00\d+ -> 0\.01\)"):  # one line, named
        train(task, target, tiny_data(), other, str(tmp_path), resume=True, log=lambda _m: None)


def test_the_trained_task_exports_official_medusa_files(tmp_path):
    task, _ = run(tmp_path / "w", 2)
    task.export(str(tmp_path / "out"), {"base_model_name_or_path": "tiny"})
    heads = read_medusa(str(tmp_path / "out"), hidden=32, vocab=64)
    assert (heads.num_heads, heads.num_layers) == (2, 1)
    assert set(heads.weights) == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight",
                                  "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}


def _ddp_worker(rank: int, world: int, port: int, work: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    try:
        _, res = run(work, 4)
        if rank == 0:
            np.save(out, np.asarray(res.losses))
    finally:
        if dist.is_initialized():  # both ranks past their last all-reduce before gloo goes, as the CLI does
            dist.barrier()
            dist.destroy_process_group()


def test_two_gloo_processes_follow_the_single_process_loss_curve(tmp_path):
    """Data parallelism (torchrun-style env, gloo on CPU): each process takes half of every batch's rows and
    DDP averages the gradients; the task code is the same. The loss curve matches one process."""
    import socket

    import torch.multiprocessing as mp

    _, single = run(tmp_path / "one", 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ddp_losses.npy")
    mp.start_processes(_ddp_worker, args=(2, port, str(tmp_path / "two"), out), nprocs=2, join=True,
                       start_method="spawn")
    assert np.allclose(np.load(out), single.losses, rtol=1e-4, atol=1e-6)


def test_train_drafter_refuses_bad_input_with_one_line_errors(tmp_path, capsys):
    from runtime.cli import main

    assert main(["train-drafter", "medusa", "--target", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json there" in capsys.readouterr().err
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "medusa_lm_head.safetensors").write_bytes(b"x")
    repo = REPO_ROOT
    argv = ["train-drafter", "medusa", "--target", os.path.join(repo, "zoo", "target"), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(argv + ["--heads", "0", "--force"]) == 2
    assert "--heads: got 0, expected 1..16" in capsys.readouterr().err


def test_a_snapshot_is_the_checkpointed_drafter_and_leaves_the_run_as_it_was(tmp_path):
    task, first = run(tmp_path, 6, pause_at=3)  # a run under way: checkpoint at step 3
    before = open(tmp_path / "ckpt.pt", "rb").read()
    target = tiny_target()
    torch.manual_seed(99)  # another initialisation: the snapshot must come from the checkpoint, not from it
    look = medusa_task(target, num_heads=2, num_layers=1)
    got = train(look, target, tiny_data(), TrainConfig(**{**CFG.__dict__, "steps": 6}), str(tmp_path),
                resume=True, log=lambda _m: None, snapshot=True)
    assert (got.steps, got.stopped, got.losses) == (3, "snapshot", [])  # no step trained
    for a, b in zip(task.state_dict().values(), look.state_dict().values()):
        assert torch.equal(a, b)
    assert open(tmp_path / "ckpt.pt", "rb").read() == before  # the run resumes where it was


def test_a_snapshot_without_a_checkpoint_is_refused_naming_the_work_directory(tmp_path, capsys):
    from runtime.cli import main

    work = tmp_path / "work"
    code = main(["train-drafter", "medusa", "--target", os.path.join(REPO_ROOT, "zoo", "target"), "--out",
                 str(tmp_path / "out"), "--work", str(work), "--snapshot"])
    err = capsys.readouterr().err
    assert code == 2 and f"--snapshot: {work / 'ckpt.pt'}: no checkpoint there" in err, err
