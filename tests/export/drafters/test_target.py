"""The trainer's torch target (export/drafters/target.py) reads every family `edgespec bundle` accepts through the
bundle's HF reader and computes what transformers computes: Qwen3 (q/k norms), Qwen2 (biases, tied head), Llama."""
import os

import numpy as np
import pytest
import torch

from export.drafters.target import load_target
from export.drafters.trainer import target_batch
from tests.support.hf_targets import FAMILIES, hf_model, save_target


@pytest.mark.parametrize("family", FAMILIES)
def test_the_torch_target_matches_transformers_logits_and_hidden_states(tmp_path, family):
    path = save_target(str(tmp_path), family)
    target, oracle = load_target(path), hf_model(path)
    ids = torch.randint(0, target.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = oracle(ids, output_hidden_states=True)
        batch = target_batch(target, ids, torch.zeros_like(ids), ("layer_in.2", "layer_out.1", "final_norm"))
    np.testing.assert_allclose(batch.logits.numpy(), want.logits.numpy(), atol=2e-4, rtol=0)
    np.testing.assert_allclose(batch.taps["layer_in.2"].numpy(), want.hidden_states[2].numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(batch.taps["layer_out.1"].numpy(), want.hidden_states[2].numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3"])
def test_generation_with_the_kv_cache_equals_full_forwards(tmp_path, family):
    target = load_target(save_target(str(tmp_path), family))
    ids = torch.tensor([[5, 9, 14, 3]])
    caches = [[] for _ in target.layers]
    last = target.step(ids, 0, caches)
    logits = [last]
    seq = ids[0].tolist()
    for _ in range(3):
        seq.append(int(last.argmax()))
        last = target.step(torch.tensor([[seq[-1]]]), len(seq) - 1, caches)
        logits.append(last)
    with torch.no_grad():
        full, _ = target(torch.tensor([seq]))
    np.testing.assert_allclose(torch.stack(logits).numpy(), full[0, 3:].numpy(), atol=1e-4, rtol=0)


def test_the_zoo_target_reads_as_the_zoo_model_class_computes_it():
    """The zoo's own checkpoint (Llama, tied head, an MTP module at model.layers.8, left out) through the one reader."""
    from export.zoo.model import load_hf
    from tests.support import REPO_ROOT

    path = os.path.join(REPO_ROOT, "zoo", "target")
    ids = torch.randint(0, 3072, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = load_hf(path)(ids)
        got, _ = load_target(path)(ids)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4, rtol=0)
