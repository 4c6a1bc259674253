"""An MTP module trained for a target that ships none (export/drafters/mtp_train.py): on a Qwen3 target (q/k norms
in its layer) the training task computes what the runtime's MTP module computes from the exported weights, and
`edgespec bundle --mtp` takes the module only where it fits the target."""
import numpy as np
import pytest
import torch

from export.drafters.mtp_train import MTPTask
from export.drafters.target import load_target
from export.drafters.trainer import target_batch
from runtime.drafters.mtp import MTPModule, module_keys, mtp_cache_shape
from runtime.memory.kv import KVArena
from tests.support.hf_targets import save_target


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_the_training_task_computes_what_the_runtime_module_computes(tmp_path, family):
    target = load_target(save_target(str(tmp_path), family))
    torch.manual_seed(1)
    task = MTPTask(target)
    with torch.no_grad():
        for p in task.parameters():
            p.add_(0.1 * torch.randn_like(p))
    T = 7
    ids = torch.randint(3, target.cfg.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(2))
    batch = target_batch(target, ids, torch.zeros_like(ids), task.taps)
    got = []
    with torch.no_grad():
        task(batch, collect=got)
    spec, n = target.spec, target.cfg.num_hidden_layers
    cache = KVArena(10 ** 6).allocate("mtp", mtp_cache_shape(spec), 64)
    embed = target.embed_tokens.weight.numpy()
    head = (target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight).numpy()
    module = MTPModule(spec, task.official_weights(), module_keys("deepseek_v3", 0, n), "deepseek_v3", cache, embed,
                       head)
    hidden = batch.taps[f"layer_out.{n - 1}"][0, :T].numpy()
    _, logits = module.run(hidden, ids[0, 1:T + 1].tolist(), 0)  # rows 0..T-1 read x_1..x_T
    np.testing.assert_allclose(logits, got[0][0, T - 1].numpy(), atol=2e-4, rtol=0)


def test_the_bundle_refuses_a_module_trained_for_another_target(tmp_path, capsys):
    from runtime.cli import main

    deep, shallow = save_target(str(tmp_path / "a"), "llama", num_layers=4), save_target(str(tmp_path / "b"), "llama",
                                                                                         num_layers=3)
    MTPTask(load_target(deep)).export(str(tmp_path / "mtp"))
    assert main(["bundle", "--target", shallow, "--mtp", str(tmp_path / "mtp"), "--out", str(tmp_path / "bundle")]) == 2
    assert "expected one MTP module after the target's 3 layers (model.layers.3.*" in capsys.readouterr().err
