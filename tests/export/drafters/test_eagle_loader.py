"""EAGLE checkpoints in the official layouts (EAGLE-1 with and without fc.bias, EAGLE-3 with and without a
reduced draft vocabulary, vLLM and speculators variants) load into a bundle; malformed ones are refused with
an error naming the key. Checkpoints are built here with random weights (tests/support/eagle_tiny.py)."""
import json
import os
import shutil

import numpy as np
import pytest

from export.drafters.eagle import add_eagle_to_bundle, default_tap_layers, load_eagle
from runtime.model import bundle as bundle_io
from runtime.errors import BundleError
from runtime.model.tensors import read_safetensors, write_safetensors
from tests.support.eagle_tiny import eagle1_checkpoint, eagle3_checkpoint
from tests.support.hf_tiny import tiny_hf_model


@pytest.fixture(scope="module")
def target_spec():
    return tiny_hf_model("llama", seed=3, num_layers=3)[1]


def test_official_eagle3_taps_are_the_inputs_of_layers_2_mid_and_n_minus_3():
    assert default_tap_layers(32) == [2, 16, 29]  # Llama-3.1-8B
    assert default_tap_layers(8) == [2, 4, 5]  # the zoo target


@pytest.mark.parametrize("bias", [True, False, None], ids=["bias", "no_bias", "bias_key_absent"])
def test_eagle1_official_layout_loads_with_and_without_fc_bias(tmp_path, target_spec, bias):
    head = load_eagle(eagle1_checkpoint(str(tmp_path / "e1"), target_spec, bias=bias), target_spec)
    assert head.kind == "eagle" and head.target_taps == ("final_norm",)
    assert head.params["bias"] is (bias is not False) and ("fc.bias" in head.weights) is (bias is not False)
    assert head.weights["fc.weight"].shape == (64, 128) and "layers.0.input_layernorm.weight" not in head.weights


def test_eagle1_speculators_layout_loads(tmp_path, target_spec):
    head = load_eagle(eagle1_checkpoint(str(tmp_path / "e1"), target_spec, bias=False, speculators=True), target_spec)
    assert head.kind == "eagle" and head.params["bias"] is False


@pytest.mark.parametrize("layout", ["official", "vllm", "speculators"])
@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full_vocab", "reduced_vocab"])
def test_eagle3_layouts_load_to_the_official_names(tmp_path, target_spec, layout, draft_vocab):
    path = eagle3_checkpoint(str(tmp_path / "e3"), target_spec, draft_vocab=draft_vocab, layout=layout)
    head = load_eagle(path, target_spec)
    assert head.kind == "eagle3"
    assert head.target_taps == ("layer_in.0", "layer_in.1", "layer_in.2")  # N = 3: layers 2, 1, 0, low -> high
    assert "midlayer.hidden_norm.weight" in head.weights and not any(k.startswith("layers.") for k in head.weights)
    assert head.params["draft_vocab_size"] == (draft_vocab or target_spec.vocab_size)
    assert head.params["norm_before_residual"] is False
    raw = read_safetensors(os.path.join(path, "model.safetensors"))
    if draft_vocab:
        d2t = raw.get("d2t", raw.get("draft_id_to_target_id"))
        np.testing.assert_array_equal(head.weights["d2t"], d2t)
        assert "t2d" not in head.weights  # checked against d2t, then dropped
    else:
        assert "d2t" not in head.weights


def test_speculators_norm_before_residual_defaults_to_true_as_vllm_reads_it(tmp_path, target_spec):
    path = eagle3_checkpoint(str(tmp_path / "e3"), target_spec, layout="speculators")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["norm_before_residual"]
    json.dump(cfg, open(cfg_path, "w"))
    assert load_eagle(path, target_spec).params["norm_before_residual"] is True


def _edit(path, drop=(), add=None, rename=None):
    f = os.path.join(path, "model.safetensors")
    w = read_safetensors(f)
    w = {(rename or {}).get(k, k): np.array(v) for k, v in w.items() if k not in drop}
    w.update(add or {})
    os.remove(f)
    write_safetensors(f, w)


def _config(path, **changes):
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    cfg.update(changes)
    json.dump(cfg, open(f, "w"))


MALFORMED = {
    "missing_layer_weight": ("e1", lambda p: _edit(p, drop=["layers.0.mlp.up_proj.weight"]), "layers.0.mlp.up_proj.weight"),
    "bias_in_config_but_no_fc_bias": ("e1", lambda p: _edit(p, drop=["fc.bias"]), "fc.bias"),
    "fc_bias_but_config_says_no_bias": ("e1", lambda p: _config(p, bias=False), "fc.bias"),
    "bias_not_a_bool": ("e1", lambda p: _config(p, bias="yes"), "bias"),
    "wrong_fc_shape": ("e1", lambda p: _edit(p, add={"fc.weight": np.zeros((64, 192), np.float32)}), "fc.weight"),
    "unexpected_key": ("e1", lambda p: _edit(p, add={"layers.1.mlp.up_proj.weight": np.zeros(3, np.float32)}),
                       "layers.1.mlp.up_proj.weight"),
    "two_layers": ("e1", lambda p: _config(p, num_hidden_layers=2), "num_hidden_layers"),
    "other_vocab": ("e1", lambda p: _config(p, vocab_size=50), "vocab_size"),
    "eagle3_missing_hidden_norm": ("e3", lambda p: _edit(p, drop=["midlayer.hidden_norm.weight"]),
                                   "midlayer.hidden_norm.weight"),
    "eagle3_qkv_not_2h": ("e3", lambda p: _edit(p, add={"midlayer.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}),
                          "midlayer.self_attn.q_proj.weight"),
    "eagle3_reduced_vocab_without_d2t": ("e3", lambda p: _edit(p, drop=["d2t", "t2d"]), "d2t"),
    "eagle3_d2t_out_of_range": ("e3", lambda p: _edit(p, add={"d2t": np.full(40, 500, np.int64)}), "d2t"),
    "eagle3_t2d_disagrees": ("e3", lambda p: _edit(p, add={"t2d": np.ones(97, bool)}), "t2d"),
    "eagle3_draft_vocab_size_disagrees": ("e3", lambda p: _config(p, draft_vocab_size=41), "draft_vocab_size"),
    "eagle3_bad_layer_ids": ("e3", lambda p: _config(p, eagle_aux_hidden_state_layer_ids=[0, 1, 9]),
                             "eagle_aux_hidden_state_layer_ids"),
    "pickle_only": ("e1", lambda p: (os.remove(os.path.join(p, "model.safetensors")),
                                     open(os.path.join(p, "pytorch_model.bin"), "wb").close()), "safetensors"),
    "no_config": ("e1", lambda p: os.remove(os.path.join(p, "config.json")), "config.json"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoints_are_refused_naming_the_key(tmp_path, target_spec, case):
    which, damage, named = MALFORMED[case]
    path = (eagle1_checkpoint(str(tmp_path / "e1"), target_spec) if which == "e1"
            else eagle3_checkpoint(str(tmp_path / "e3"), target_spec, draft_vocab=40))
    damage(path)
    with pytest.raises(BundleError) as err:
        load_eagle(path, target_spec)
    assert named in str(err.value), str(err.value)


def test_heads_for_another_target_width_are_refused(tmp_path, target_spec):
    from dataclasses import replace

    other = replace(target_spec, hidden_size=32, head_dim=8)
    path = eagle1_checkpoint(str(tmp_path / "e1"), other)
    with pytest.raises(BundleError, match="hidden_size 32 differs from the target's 64"):
        load_eagle(path, target_spec)


def test_heads_are_added_to_a_bundle_as_drafters(tmp_path, tiny_bundle):
    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    spec = bundle_io.load(root).target.spec
    add_eagle_to_bundle(root, eagle1_checkpoint(str(tmp_path / "e1"), spec), name="eagle")
    add_eagle_to_bundle(root, eagle3_checkpoint(str(tmp_path / "e3"), spec, draft_vocab=100), name="eagle3")
    b = bundle_io.load(root)
    assert b.drafters["eagle"].kind == "eagle" and b.drafters["eagle"].target_taps == ("final_norm",)
    assert b.drafters["eagle3"].kind == "eagle3" and b.drafters["eagle3"].params["draft_vocab_size"] == 100
    assert b.drafters["eagle3"].spec.num_layers == 1
    with pytest.raises(BundleError, match="already has a drafter 'eagle'"):
        add_eagle_to_bundle(root, str(tmp_path / "e1"), name="eagle")


@pytest.mark.parametrize("given,passed_as,flag", [("e3", "eagle", "--eagle3"), ("e1", "eagle3", "--eagle ")],
                         ids=["eagle3_head_given_to_eagle", "eagle1_head_given_to_eagle3"])
def test_a_head_of_the_other_eagle_kind_is_refused_naming_the_flag_to_use(tmp_path, target_spec, given, passed_as,
                                                                          flag):
    path = (eagle1_checkpoint(str(tmp_path / "e1"), target_spec) if given == "e1"
            else eagle3_checkpoint(str(tmp_path / "e3"), target_spec, draft_vocab=40))
    with pytest.raises(BundleError) as err:
        load_eagle(path, target_spec, passed_as)
    assert f"pass it with `edgespec bundle {flag}" in str(err.value) and "missing" not in str(err.value), err.value
