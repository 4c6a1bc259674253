"""The feature cache (export/drafters/features.py) and the held-out curve of the trainer: features read from the
cache equal the target's features computed on the fly for the same rows; a kind that needs other taps adds them
without recomputing the rest; a run paused and resumed from its checkpoint continues the same loss and held-out
curve; --until-plateau's rule stops a run whose held-out tau no longer rises."""
import json
import os

import numpy as np
import pytest
import torch

from export.drafters.eagle_train import EagleTask
from export.drafters.features import CachedSource, FeatureCache, cache_rows, heldout_batches
from export.drafters.target import load_target
from export.drafters.trainer import TrainConfig, evaluate, plateaued, target_batch, train
from tests.support.hf_targets import save_target

CFG = TrainConfig(steps=6, budget_s=3600.0, lr=3e-3, warmup=1, batch=2, seq_len=16, seed=3, log_every=1, threads=1,
                  top_k=8, eval_every=2)
TAPS = ("layer_in.1", "layer_in.2", "final_norm")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_target(str(tmp_path_factory.mktemp("t")), "qwen3"))


def tiny_data(vocab):
    rng = np.random.default_rng(0)
    base = rng.integers(3, vocab, 12)
    make = lambda n: [np.roll(base, int(rng.integers(0, 12)))[: int(rng.integers(5, 11))].astype(np.int32)
                      for _ in range(n)]
    return {"planner_train": make(30), "planner_heldout": make(6)}


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-6), ("float16", 2e-2)])
def test_features_from_the_cache_equal_features_computed_on_the_fly(tmp_path, target, dtype, atol):
    ids, doc = cache_rows(tiny_data(target.cfg.vocab_size), CFG, 6)
    cache = FeatureCache(str(tmp_path), target, ids, doc, top_k=8, dtype=dtype, shard_rows=4)  # 2 shards
    cache.fill(TAPS, batch=3)
    rows = np.array([5, 0, 3])  # across both shards, out of order
    got = cache.batch(rows, TAPS)
    want = target_batch(target, torch.from_numpy(ids[rows]).long(), torch.from_numpy(doc[rows]).long(), TAPS, top_k=8)
    for name in ("ids", "positions", "attn_mask", "doc"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    finite = torch.isfinite(want.logits)  # the top 8 of V, and column V: the rest's log-sum-exp
    assert torch.equal(torch.isfinite(got.logits), finite) and int(finite[..., :-1].sum(-1).max()) == 8
    assert got.logits.shape[-1] == target.cfg.vocab_size + 1 and bool(finite[..., -1].all())
    np.testing.assert_allclose(got.logits[finite].numpy(), want.logits[finite].numpy(), atol=atol * 10, rtol=atol)
    for tap in TAPS:
        np.testing.assert_allclose(got.taps[tap].numpy(), want.taps[tap].numpy(), atol=atol, rtol=atol)


def test_a_kind_needing_other_taps_adds_them_to_the_same_cache(tmp_path, target):
    ids, doc = cache_rows(tiny_data(target.cfg.vocab_size), CFG, 4)
    first = FeatureCache(str(tmp_path), target, ids, doc, top_k=8)
    first.fill(("final_norm",), batch=2)
    logits_file = first._file(0, "logit_val")
    stamp = os.stat(logits_file).st_mtime_ns
    again = FeatureCache(str(tmp_path), target, ids, doc, top_k=8)
    assert again.dir == first.dir and again.missing(0, ("final_norm", "layer_out.2")) == ("layer_out.2",)
    again.fill(("final_norm", "layer_out.2"), batch=2)
    assert os.stat(logits_file).st_mtime_ns == stamp and not again.missing(0, ("layer_out.2",))
    other = FeatureCache(str(tmp_path), target, ids, doc, top_k=4)  # another k: another key
    assert other.dir != first.dir


def run(target, work, steps, cache_dir, resume=False, pause_at=None, cfg=CFG):
    data = tiny_data(target.cfg.vocab_size)
    torch.manual_seed(1)
    task = EagleTask("eagle3", target, unroll=2)
    cfg = TrainConfig(**{**cfg.__dict__, "steps": steps})
    train_cache = FeatureCache(cache_dir, target, *cache_rows(data, cfg, 4), cfg.top_k)
    held_cache = FeatureCache(cache_dir, target, *cache_rows(data, cfg, 2, split="heldout"), cfg.top_k)
    for c in (train_cache, held_cache):
        c.fill(task.taps, cfg.batch)
    return train(task, target, None, cfg, str(work), resume=resume, log=lambda _m: None, pause_at=pause_at,
                 source=CachedSource(train_cache, cfg, task.taps), heldout=heldout_batches(held_cache, task.taps, 2))


def test_a_resumed_run_continues_the_same_loss_and_heldout_curve(tmp_path, target):
    cache = str(tmp_path / "cache")
    whole = run(target, tmp_path / "a", 6, cache)
    assert [p["step"] for p in whole.curve] == [2, 4, 6]  # 3 epochs of 2 steps over the 4 cached rows
    first = run(target, tmp_path / "b", 6, cache, pause_at=3)
    rest = run(target, tmp_path / "b", 6, cache, resume=True)
    assert (first.stopped, rest.stopped, rest.steps) == ("paused", "steps", 6)
    np.testing.assert_allclose(first.losses + rest.losses, whole.losses, rtol=1e-5, atol=1e-6)
    strip = lambda curve: [{k: v for k, v in p.items() if k != "seconds"} for p in curve]
    with open(tmp_path / "b" / "curve.json") as f:
        saved = json.load(f)["points"]
    assert strip(saved) == strip(rest.curve)
    np.testing.assert_allclose([p["tau"] for p in rest.curve], [p["tau"] for p in whole.curve], rtol=1e-5)
    np.testing.assert_allclose([p["per_depth"] for p in rest.curve], [p["per_depth"] for p in whole.curve], atol=1e-6)


def test_until_plateau_stops_a_run_whose_heldout_tau_no_longer_rises(tmp_path, target):
    frozen = TrainConfig(**{**CFG.__dict__, "lr": 1e-30, "until_plateau": True, "patience": 2, "eval_every": 1})
    res = run(target, tmp_path / "w", 10**6, str(tmp_path / "cache"), cfg=frozen)
    assert res.stopped == "plateau" and res.steps == 3  # evaluations at 1, 2, 3: two without a gain after the first


def test_the_plateau_rule_and_expected_tau():
    assert plateaued([2.0, 2.5, 2.51, 2.52], patience=2, min_gain=0.01)
    assert not plateaued([2.0, 2.5, 2.51, 2.6], patience=2, min_gain=0.01)
    assert not plateaued([2.0, 2.0], patience=2, min_gain=0.01)  # not enough evaluations to judge

    class Fixed(torch.nn.Module):
        def forward(self, _batch):
            self.tally = [(8, 10), (5, 10)]
            return torch.zeros(()), {}

    assert evaluate(Fixed(), [None])["tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
