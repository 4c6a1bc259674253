"""DFlash / DFlash-2 training (export/drafters/dflash_train.py, on the shared trainer): every block the task
trains computes exactly what the runtime drafter computes for that anchor after committing the tokens before
it (same context rows, positions, non-causal block, local mixing; a block trained at length L equals the
runtime's block of L rows), the selector is trained on the walk's conditional after the true predecessor,
and a few trainer steps lower the loss and export files the official-layout loader and a bundle read."""
from tests.support import REPO_ROOT
import numpy as np
import pytest
import torch

from export.drafters.dflash import add_dflash_drafter, read_dflash_checkpoint
from export.drafters.dflash_train import DFlashTask
from export.drafters.trainer import TrainConfig, target_batch, train
from export.zoo.model import LlamaConfig, LlamaLM
from runtime.model.bundle import BundleWriter
from runtime.drafters.dflash import DFlashDrafter, pair_scores
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


def runtime_drafter(task, ck_spec, ck_params, embed):
    arena = KVArena(10 ** 7)
    cache = arena.allocate("draft", CacheShape(ck_spec.num_layers, ck_spec.num_kv_heads, ck_spec.head_dim), 64)
    # float32 weights (the export is fp16): the comparison is of the maths, not of the rounding
    return DFlashDrafter(ck_spec, ck_params, task.official_weights(), embed, embed, cache)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_trained_blocks_equal_the_runtime_drafters_block_and_the_export_loads(tmp_path, target, kind):
    torch.manual_seed(1)
    task = DFlashTask(kind, target, layers=2, block_size=6, block_sizes=(4, 6), anchors=5, mask_token_id=0,
                      conv_group_size=8, selector_rank=8, selector_top_k=61)
    with torch.no_grad():
        for p in task.parameters():
            p.add_(0.2 * torch.randn_like(p))
    T = 24
    ids = torch.randint(3, CFG.vocab_size, (1, T))
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, 15:] = 1  # two documents: a block never sees the other document's context
    batch = target_batch(target, ids, doc, task.taps)
    got = []
    with torch.no_grad():
        task(batch, collect=got)
    anchors, logits = got[0]
    _, ok, length = task._anchors(batch)
    task.export(str(tmp_path / "drafter"))
    ck = read_dflash_checkpoint(str(tmp_path / "drafter"), spec_of(CFG))  # the official-layout loader
    assert ck.kind == kind and ck.params.block_size == 6 and ck.params.target_layer_ids == task.layer_ids
    embed = target.embed_tokens.weight.detach().numpy()
    taps = {k: v[0].numpy() for k, v in batch.taps.items()}
    tokens = ids[0].tolist()
    checked = set()
    for a in range(anchors.shape[1]):
        if not ok[0, a]:
            continue
        p, L = int(anchors[0, a]), int(length[0, a])
        start = 0 if p < 15 else 15  # the document's first position; positions restart there
        drafter = runtime_drafter(task, ck.spec, ck.params, embed)
        drafter.begin(tokens[start:p], {k: v[start:p] for k, v in taps.items()})
        hidden, ref = drafter.forward(tokens[p], p - start, L)
        np.testing.assert_allclose(logits[0, a, :L - 1].numpy(), ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
        checked.add(L)
        if kind == "dflash2":  # the selector term the task adds = the runtime walk's pair score, true predecessor
            w = drafter.w
            proj = hidden[0] @ w["candidate_selector.hidden_projection.weight"].T
            pair = pair_scores(proj, w["candidate_selector.predecessor_codebook"][[tokens[p]]],
                               w["candidate_selector.successor_codebook"])[0]
            sel = task.candidate_selector
            with torch.no_grad():
                hp = sel.hidden_projection(torch.from_numpy(hidden[0]))
                mine = (sel.predecessor_codebook[tokens[p]] * hp) @ sel.successor_codebook.T
            np.testing.assert_allclose(mine.numpy(), pair, atol=1e-4, rtol=0)
    assert checked == {4, 6}, checked  # both trained block lengths were compared


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_few_trainer_steps_lower_the_loss_and_the_export_joins_a_bundle(tmp_path, target, kind):
    from export.drafters.data import DOMAINS

    rng = np.random.default_rng(0)
    data = {f"{d}_train": [list(rng.integers(3, 61, 40)) for _ in range(20)] for d in DOMAINS}
    task = DFlashTask(kind, target, layers=1, block_size=8, block_sizes=(4, 8), anchors=8, conv_group_size=8,
                      selector_rank=8)
    cfg = TrainConfig(steps=15, budget_s=600, lr=3e-3, warmup=2, batch=2, seq_len=32, threads=1, log_every=100)
    res = train(task, target, data, cfg, str(tmp_path / "work"), log=lambda m: None)
    assert res.steps == 15 and np.mean(res.losses[-3:]) < np.mean(res.losses[:3])
    task.export(str(tmp_path / kind))
    ck = read_dflash_checkpoint(str(tmp_path / kind), spec_of(CFG))
    assert ck.kind == kind and ck.spec.num_layers == 1 and ck.other_block_sizes == (4,)
    w = BundleWriter(str(tmp_path / "bundle"), "b")  # one drafter per trained block size, on one file
    add_dflash_drafter(w, str(tmp_path / kind), spec_of(CFG))
    entries = w.manifest["drafters"]
    assert {n: e["params"]["block_size"] for n, e in entries.items()} == {kind: 8, f"{kind}_b4": 4}
    assert entries[kind]["files"] == entries[f"{kind}_b4"]["files"]


def test_train_drafter_dflash_refuses_bad_block_sizes_with_a_one_line_error(tmp_path, capsys):
    import os

    from runtime.cli import main

    repo = REPO_ROOT
    argv = ["train-drafter", "dflash2", "--target", os.path.join(repo, "zoo", "target"), "--out", str(tmp_path / "o")]
    assert main(argv + ["--block-sizes", "1,16"]) == 2
    assert "--block-sizes: got '1,16'" in capsys.readouterr().err
    assert main(argv + ["--layers", "0"]) == 2
    assert "--layers: got 0, expected 1..8" in capsys.readouterr().err
