"""The EAGLE training task (export/drafters/eagle_train.py, on the shared trainer) computes, at unrolled step
j, exactly what the runtime drafter computes for a draft row of depth j (same features, tokens, positions and
attention: the training-time test is the runtime's chain); a few trainer steps lower the loss and export a
checkpoint that the official-layout loader reads back."""
import numpy as np
import pytest
import torch

from export.drafters.eagle import load_eagle
from export.drafters.eagle_train import EagleTask
from export.drafters.trainer import TrainConfig, target_batch, train
from export.zoo.model import LlamaConfig, LlamaLM
from runtime.drafters.shared import tree_mask
from runtime.drafters.eagle import EagleDrafter
from runtime.memory.kv import CacheShape, KVArena
from runtime.model.spec import ModelSpec

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)


def spec_of(cfg):
    return ModelSpec.from_hf_config(dict(cfg.hf_dict(), model_type="llama"))


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaLM(CFG).eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unrolled_training_steps_equal_the_runtime_drafters_chain_rows(tmp_path, target, kind):
    torch.manual_seed(1)
    task = EagleTask(kind, target, unroll=3)
    with torch.no_grad():
        for p in task.parameters():
            p.add_(0.3 * torch.randn_like(p))
    T, root = 12, 5
    ids = torch.randint(3, CFG.vocab_size, (1, T))
    batch = target_batch(target, ids, torch.zeros(1, T, dtype=torch.long), task.taps)
    steps = []
    with torch.no_grad():
        task(batch, collect=steps)
    task.export(str(tmp_path / "head"))
    head = load_eagle(str(tmp_path / "head"), spec_of(CFG))
    arena = KVArena(10 ** 6)
    cache = arena.allocate("draft", CacheShape(1, CFG.num_key_value_heads, CFG.head_dim), 64)
    embed = target.embed_tokens.weight.detach().numpy()
    # float32 weights (the export is fp16): the comparison is of the maths, not of the rounding
    drafter = EagleDrafter(head.kind, head.spec, task.official_weights(), embed, embed, cache, head.params)
    taps = {k: v[0].numpy() for k, v in batch.taps.items()}
    tokens = ids[0].tolist()
    drafter.pending = drafter._features(taps)[:root + 1]  # committed rows 0..root (target features)
    h, logits = drafter._catch_up(tokens[:root + 2])
    atol = 2e-3
    np.testing.assert_allclose(logits, steps[0][0, root].numpy(), atol=atol, rtol=0)
    rows = []
    for j in (1, 2):  # depth-j row: own feature, the true token x_{root+j+1}, position root + j
        start = drafter.cache.length
        out = drafter._run(h, [tokens[root + j + 1]], np.asarray([root + j]), tree_mask(drafter.committed_rows, [rows], start))
        rows.append(start)
        h = out
        np.testing.assert_allclose(drafter._logits(out)[0], steps[j][0, root + j].numpy(), atol=atol, rtol=0)


@pytest.mark.slow
def test_a_few_trainer_steps_lower_the_loss_and_export_loads(tmp_path, target):
    from export.drafters.data import DOMAINS

    rng = np.random.default_rng(0)
    data = {f"{d}_train": [list(rng.integers(3, 61, 40)) for _ in range(20)] for d in DOMAINS}
    task = EagleTask("eagle3", target, unroll=2)
    cfg = TrainConfig(steps=12, budget_s=600, lr=3e-3, warmup=2, batch=2, seq_len=32, threads=1, log_every=100)
    res = train(task, target, data, cfg, str(tmp_path / "work"), log=lambda m: None)
    assert res.steps == 12 and np.mean(res.losses[-3:]) < np.mean(res.losses[:3])
    task.export(str(tmp_path / "head"))
    assert load_eagle(str(tmp_path / "head"), spec_of(CFG)).kind == "eagle3"


def _eagle_run(work, steps):
    from export.drafters.data import DOMAINS

    torch.manual_seed(0)
    target = LlamaLM(CFG).eval()
    rng = np.random.default_rng(0)
    data = {f"{d}_train": [list(rng.integers(3, 61, 24)) for _ in range(8)] for d in DOMAINS}
    torch.manual_seed(1)
    task = EagleTask("eagle3", target, unroll=2)
    cfg = TrainConfig(steps=steps, budget_s=600, lr=3e-3, warmup=1, batch=2, seq_len=16, seed=3, threads=1, log_every=100)
    return train(task, target, data, cfg, str(work), log=lambda m: None)


def _eagle_ddp_worker(rank: int, world: int, port: int, work: str, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    try:
        res = _eagle_run(work, 3)
        if rank == 0:
            np.save(out, np.asarray(res.losses))
    finally:
        if dist.is_initialized():
            # both ranks past their last all-reduce before gloo goes (as the CLI does): a rank tearing it down
            # while its peer still talks to it aborts the peer ("terminate called without an active exception")
            dist.barrier()
            dist.destroy_process_group()


@pytest.mark.slow
def test_eagle_training_on_two_gloo_processes_follows_the_single_process_loss_curve(tmp_path):
    """torchrun-style data parallelism (gloo on CPU) on the EAGLE-3 task with its training-time test: each process
    takes half of every batch's rows, DDP averages the gradients; the loss curve equals one process's."""
    import socket

    import torch.multiprocessing as mp

    single = _eagle_run(tmp_path / "one", 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ddp_losses.npy")
    mp.start_processes(_eagle_ddp_worker, args=(2, port, str(tmp_path / "two"), out), nprocs=2, join=True,
                       start_method="spawn")
    assert np.allclose(np.load(out), single.losses, rtol=1e-4, atol=1e-6)
    assert len(single.losses) == 3
