"""Medusa head files in the official layouts are read (Medusa-1 safetensors and pickled .pt, Medusa-2 heads
under `medusa_head.` in a full checkpoint), the head and layer counts come from the keys, and a malformed
file is refused with an error naming the key. Files are built in the test with the official key names."""
import argparse
import json
import os

import numpy as np
import pytest
import torch

from export.drafters.medusa import read_medusa, tune_tree, write_medusa
from runtime.errors import BundleError
from runtime.model.tensors import write_safetensors

H, V = 8, 16


def official_heads(num_heads=3, num_layers=2, seed=0):
    rng = np.random.default_rng(seed)
    w = {}
    for h in range(num_heads):
        for l in range(num_layers):
            w[f"{h}.{l}.linear.weight"] = rng.standard_normal((H, H)).astype(np.float32)
            w[f"{h}.{l}.linear.bias"] = rng.standard_normal(H).astype(np.float32)
        w[f"{h}.{num_layers}.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    return w


def test_medusa1_safetensors_head_count_comes_from_the_keys_not_the_config(tmp_path):
    w = official_heads(3, 2)
    write_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), w)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 2}))
    heads = read_medusa(str(tmp_path), hidden=H, vocab=V)
    assert (heads.num_heads, heads.num_layers) == (3, 2)
    assert set(heads.weights) == set(w)
    assert all(np.array_equal(heads.weights[k], w[k]) for k in w)


def test_medusa1_pickled_pt_is_read_with_weights_only(tmp_path):
    w = official_heads(2, 1)
    torch.save({k: torch.from_numpy(v) for k, v in w.items()}, str(tmp_path / "medusa_lm_head.pt"))
    heads = read_medusa(str(tmp_path / "medusa_lm_head.pt"))
    assert (heads.num_heads, heads.num_layers) == (2, 1)
    assert np.array_equal(heads.weights["1.1.weight"], w["1.1.weight"])


def test_a_pickle_holding_code_objects_is_refused(tmp_path):
    torch.save({"0.0.linear.weight": torch.zeros(H, H), "extra": argparse.Namespace(a=1)}, str(tmp_path / "medusa_lm_head.pt"))
    with pytest.raises(BundleError, match="weights_only"):
        read_medusa(str(tmp_path / "medusa_lm_head.pt"))


def test_medusa2_heads_are_taken_from_the_full_checkpoint(tmp_path):
    w = official_heads(2, 1)
    full = {f"medusa_head.{k}": v for k, v in w.items()}
    full["model.embed_tokens.weight"] = np.zeros((V, H), np.float32)
    full["model.norm.weight"] = np.ones(H, np.float32)
    write_safetensors(str(tmp_path / "model.safetensors"), full)
    for source in (str(tmp_path), str(tmp_path / "model.safetensors")):
        heads = read_medusa(source, hidden=H, vocab=V)
        assert (heads.num_heads, heads.num_layers) == (2, 1)
        assert set(heads.weights) == set(w)


def test_zero_resblock_heads_are_a_plain_projection(tmp_path):
    w = {"0.0.weight": np.ones((V, H), np.float32), "1.0.weight": np.ones((V, H), np.float32)}
    write_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), w)
    heads = read_medusa(str(tmp_path))
    assert (heads.num_heads, heads.num_layers) == (2, 0)


@pytest.mark.parametrize("break_it, key", [
    (lambda w: w.pop("1.0.linear.bias"), "1.0.linear.bias"),
    (lambda w: w.update({"0.0.linear.wieght": w.pop("0.0.linear.weight")}), "0.0.linear.wieght"),
    (lambda w: w.update({"2.1.weight": np.zeros((V + 1, H), np.float32)}), "2.1.weight"),
    (lambda w: w.update({"1.0.linear.weight": np.zeros((H, H + 1), np.float32)}), "1.0.linear.weight"),
    (lambda w: w.pop("2.1.weight"), "2.1.weight"),
    (lambda w: [w.pop(k) for k in list(w) if k.startswith("1.")], "no key starts with 1"),
], ids=["missing-bias", "misspelt", "vocab-rows", "resblock-shape", "missing-projection", "head-gap"])
def test_malformed_head_files_are_refused_naming_the_key(tmp_path, break_it, key):
    w = official_heads(3, 1)
    break_it(w)
    write_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), w)
    with pytest.raises(BundleError) as err:
        read_medusa(str(tmp_path), hidden=H, vocab=V)
    assert key in str(err.value)


def test_heads_for_another_target_are_refused(tmp_path):
    write_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), official_heads(2, 1))
    with pytest.raises(BundleError, match="hidden size 8, the target's is 32"):
        read_medusa(str(tmp_path), hidden=32, vocab=V)


def test_written_heads_read_back_in_the_official_layout_as_fp16(tmp_path):
    w = official_heads(2, 1)
    write_medusa(str(tmp_path), w, {"base_model_name_or_path": "x"})
    assert sorted(os.listdir(tmp_path)) == ["config.json", "medusa_lm_head.safetensors"]
    heads = read_medusa(str(tmp_path))
    assert heads.weights["0.1.weight"].dtype == np.float16
    assert heads.config["medusa_num_heads"] == 2
    assert np.allclose(heads.weights["0.1.weight"], w["0.1.weight"], atol=2e-3)


def test_tree_tuning_adds_the_likeliest_paths_first():
    choices, tau = tune_tree(np.array([[0.6, 0.2], [0.5, 0.1]]), max_nodes=3)
    assert choices == [[0], [1], [0, 0]]
    assert tau == pytest.approx(2.1)


def test_bundle_with_medusa_heads_serves_both_drafters_through_a_session(tiny_bundle, tmp_path):
    """`edgespec bundle --medusa` path: the heads go into the bundle as `medusa` (tree) and `medusa_chain`; a
    Session runs each, greedy output equal to plain decoding, the heads counted in its memory."""
    from export.bundle.builder import build_bundle
    from runtime.model import bundle as bundle_io
    from runtime.serving.session import GenerationParams, Session

    root = os.path.dirname(tiny_bundle)
    spec = bundle_io.load(tiny_bundle).target.spec
    rng = np.random.default_rng(0)
    w = {}
    for h in range(3):
        w[f"{h}.0.linear.weight"] = (0.1 * rng.standard_normal((spec.hidden_size,) * 2)).astype(np.float32)
        w[f"{h}.0.linear.bias"] = np.zeros(spec.hidden_size, np.float32)
        w[f"{h}.1.weight"] = rng.standard_normal((spec.vocab_size, spec.hidden_size)).astype(np.float32)
    write_medusa(str(tmp_path / "heads"), w, {"medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]})
    out = build_bundle(os.path.join(root, "target"), str(tmp_path / "bundle"), medusa=str(tmp_path / "heads"))
    b = bundle_io.load(out)
    assert b.drafters["medusa"].kind == b.drafters["medusa_chain"].kind == "medusa"
    assert b.drafters["medusa"].params["tree"] == [[0], [1], [0, 0], [1, 0], [0, 0, 0]]
    assert b.drafters["medusa"].files == ("medusa/medusa_lm_head.safetensors",)
    params = GenerationParams(max_tokens=16)
    plain = Session.open(out, drafter="none", backend="numpy_ref")
    want = plain.generate("navigate to the kitchen", params).token_ids
    for name in ("medusa", "medusa_chain"):
        s = Session.open(out, drafter=name, backend="numpy_ref")
        assert s.generate("navigate to the kitchen", params).token_ids == want, name
        assert s.memory_in_use() > plain.memory_in_use() + 3 * spec.vocab_size * spec.hidden_size * 4
        s.close()
    plain.close()


def test_top_k_accuracy_never_falls_with_k_and_the_log_names_both_measures():
    from export.drafters.medusa import accuracy_report, top_k_accuracy
    by_rank = np.array([[0.23, 0.12, 0.08, 0.05, 0.03], [0.10, 0.07, 0.05, 0.04, 0.02]])  # rank-i candidate alone
    top = top_k_accuracy(by_rank)
    np.testing.assert_allclose(top[0], [0.23, 0.35, 0.43, 0.48, 0.51])
    assert (np.diff(top, axis=1) >= 0).all()
    line = accuracy_report(by_rank)[0]
    assert line == "head 0: top-1..5 accuracy 0.23 0.35 0.43 0.48 0.51; rank-1..5 candidate alone 0.23 0.12 0.08 0.05 0.03"
