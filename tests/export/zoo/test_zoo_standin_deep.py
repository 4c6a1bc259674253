"""The deep stand-in (export/zoo/standin.py `deepen`, `edgespec zoo standin --depth D --robot`): the zoo's 8 layers
spread over D with zero-contribution layers between predict what the zoo target predicts (logits, MTP), and every
drafter tap renamed through the layer map (EAGLE-3's layer inputs, DFlash's layer outputs) reads the zoo target's
own hidden state there. Checked on a small widening (256 -> 384) and depth 8 -> 20 so that the test is fast."""
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from export.bundle.hf_reader import read_hf_checkpoint
from export.drafters.dflash import default_target_layer_ids
from export.drafters.eagle import default_tap_layers
from export.zoo.cli import ROBOT
from export.zoo.standin import layer_map, remap_taps, write_standin
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.errors import ConfigError
from runtime.memory.kv import KVArena
from runtime.text.prompts import planner_prompt
from tests.export.zoo.test_zoo_standin import ZOO_TARGET, run_target_and_mtp
from tests.support import REPO_ROOT

DEPTH = 20


@pytest.fixture(scope="module")
def zoo_and_deep(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("deep"))
    write_standin(ZOO_TARGET, out, hidden=384, intermediate=1024, kv_heads=4, depth=DEPTH, heads=False)
    return read_hf_checkpoint(ZOO_TARGET), read_hf_checkpoint(out)


def ids():
    tok = Tokenizer.from_file(os.path.join(ZOO_TARGET, "tokenizer.json"))
    return tok.encode(planner_prompt("give the red box from the workshop to Carol in the bedroom")).ids


def taps_of(spec, weights, tokens, names):
    arena = KVArena.for_context({"t": cache_shape(spec)}, 80)
    target = NumpyTarget(spec, weights, arena.allocate("t", cache_shape(spec), 64))
    return target.forward(np.array(tokens), np.arange(len(tokens)), taps=tuple(names)).taps


def test_the_deep_standin_predicts_what_the_zoo_target_predicts(zoo_and_deep):
    zoo, deep = zoo_and_deep
    logits, q = run_target_and_mtp(zoo.spec, zoo.weights, ids())
    deep_logits, deep_q = run_target_and_mtp(deep.spec, deep.weights, ids())
    assert deep.spec.num_layers == DEPTH and deep.config["edgespec_standin"]["layer_map"] == layer_map(8, DEPTH)
    assert np.max(np.abs(deep_logits - logits)) < 1e-3 and (deep_logits.argmax(-1) == logits.argmax(-1)).all()
    assert np.max(np.abs(deep_q - q)) < 1e-4  # the MTP module, moved to model.layers.{DEPTH}


def test_renamed_taps_read_the_zoo_targets_hidden_states_on_real_layers(zoo_and_deep):
    zoo, deep = zoo_and_deep
    where = layer_map(8, DEPTH)
    eagle = remap_taps({"hidden_size": 256}, where, DEPTH, eagle3=True)["eagle_aux_hidden_state_layer_ids"]
    dflash = remap_taps({"num_hidden_layers": 2, "num_target_layers": 8, "dflash_config": {}}, where, DEPTH)
    assert eagle == [where[i] for i in default_tap_layers(8)] and dflash["num_target_layers"] == DEPTH
    pairs = [(f"layer_in.{i}", f"layer_in.{where[i]}") for i in default_tap_layers(8)]
    pairs += [(f"layer_out.{i}", f"layer_out.{j}") for i, j in
              zip(default_target_layer_ids(8, 2), dflash["dflash_config"]["target_layer_ids"])]
    small = taps_of(zoo.spec, zoo.weights, ids(), [a for a, _ in pairs])
    big = taps_of(deep.spec, deep.weights, ids(), [b for _, b in pairs])
    for a, b in pairs:
        assert np.max(np.abs(big[b][:, :256] - small[a])) < 1e-3, (a, b)
        assert np.all(big[b][:, 256:] == 0), b
    # and the zero layers really pass the stream unchanged: the tap just before a real layer is the same
    before = taps_of(deep.spec, deep.weights, ids(), [f"layer_out.{where[3] - 1}", f"layer_in.{where[3]}"])
    assert np.array_equal(before[f"layer_out.{where[3] - 1}"], before[f"layer_in.{where[3]}"])


def test_a_depth_below_the_models_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="^--depth: got 6"):
        layer_map(8, 6)


def test_the_robot_preset_has_a_robot_models_proportions():
    """Depth and bytes as the preset writes them (computed from the shapes, no 0.5 GB written in a test)."""
    with open(os.path.join(REPO_ROOT, "zoo", "target", "config.json")) as f:
        zoo = json.load(f)
    with open(os.path.join(REPO_ROOT, "zoo", "draft", "config.json")) as f:
        draft = json.load(f)

    def params(hidden, inter, kv, layers, vocab, d=32):
        return layers * (2 * hidden * hidden + 2 * kv * d * hidden + 3 * hidden * inter) + vocab * hidden

    r = ROBOT
    target = params(r["hidden"], r["intermediate"], r["kv_heads"], r["depth"], zoo["vocab_size"])
    d = params(r["draft_hidden"], r["draft_intermediate"], 6, draft["num_hidden_layers"], draft["vocab_size"])
    assert 400e6 <= 4 * target <= 600e6  # the fp32 target streams 0.4-0.6 GB per step
    assert 0.06 <= d / target <= 0.09  # the draft model at a 0.6 B : 8 B share
    head = target / r["depth"] - zoo["vocab_size"] * r["hidden"] / r["depth"]  # one decoder layer: a head's share
    assert head == 2 * 512 * 512 + 2 * 8 * 32 * 512 + 3 * 512 * r["intermediate"]
    # no MLP as wide as the vocabulary: onnxruntime-genai's builder would take it for the LM head (its peer rows)
    assert zoo["vocab_size"] not in (r["intermediate"], r["draft_intermediate"])
