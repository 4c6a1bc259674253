"""The memory-bound stand-in (export/zoo/standin.py) predicts what the zoo target predicts: its logits and
its MTP module's draft distribution equal the original's in the numpy reference. Checked on a small
widening (hidden 256 -> 384, SwiGLU 768 -> 1024, 8/4 heads -> 12/4: new group size 3, not a power of two)
so that the test is fast; `edgespec zoo standin` builds the 1024-wide one with the same code."""
from tests.support import REPO_ROOT
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from export.bundle.hf_reader import read_hf_checkpoint
from export.zoo.standin import head_slots, widen, write_standin
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.drafters.base import DraftContext
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.errors import ConfigError
from runtime.memory.kv import KVArena
from runtime.model.spec import ModelSpec
from runtime.text.prompts import planner_prompt
from runtime.sampling import SamplingParams

ZOO_TARGET = os.path.join(REPO_ROOT, "zoo", "target")


def run_target_and_mtp(spec, weights, ids):
    """(target logits (T, V), MTP draft distribution after ids) in the numpy reference."""
    arena = KVArena.for_context({"t": cache_shape(spec), "m": mtp_cache_shape(spec)}, 80)
    target = NumpyTarget(spec, weights, arena.allocate("t", cache_shape(spec), 64))
    embed = target.w["model.embed_tokens.weight"]
    drafter = MTPDrafter(spec, weights, embed, embed, arena.allocate("m", mtp_cache_shape(spec), 72), 1)
    res = target.forward(np.array(ids[:-1]), np.arange(len(ids) - 1), taps=drafter.target_taps)
    drafter.begin(ids[:-1], res.taps)
    tree = drafter.propose(DraftContext(ids, SamplingParams(temperature=1.0), np.random.default_rng(0), 8))
    return res.logits, tree.q[0]


@pytest.fixture(scope="module")
def zoo_and_standin(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("standin"))
    params = write_standin(ZOO_TARGET, out, hidden=384, intermediate=1024, kv_heads=4)
    return read_hf_checkpoint(ZOO_TARGET), read_hf_checkpoint(out), params


def test_standin_logits_and_mtp_drafts_equal_the_zoo_targets(zoo_and_standin):
    zoo, standin, _ = zoo_and_standin
    tok = Tokenizer.from_file(os.path.join(ZOO_TARGET, "tokenizer.json"))
    ids = tok.encode(planner_prompt("give the red box from the workshop to Carol in the bedroom")).ids
    logits, q = run_target_and_mtp(zoo.spec, zoo.weights, ids)
    wide_logits, wide_q = run_target_and_mtp(standin.spec, standin.weights, ids)
    assert standin.spec.hidden_size == 384 and standin.spec.num_heads == 12 and standin.spec.num_kv_heads == 4
    assert np.max(np.abs(wide_logits - logits)) < 1e-3  # float32 sums over more (zero) terms: ~1e-5 seen
    assert (wide_logits.argmax(-1) == logits.argmax(-1)).all()
    assert np.max(np.abs(wide_q - q)) < 1e-4


def test_standin_checkpoint_is_an_hf_llama_with_its_provenance(zoo_and_standin):
    zoo, standin, params = zoo_and_standin
    assert standin.config["edgespec_standin"]["widened_from"]["hidden_size"] == 256
    assert standin.config["rms_norm_eps"] == pytest.approx(zoo.config["rms_norm_eps"] * 256 / 384)
    assert standin.tokenizer_file is not None and all(d == "F32" for d in standin.dtypes.values())
    assert params == sum(w.size for w in standin.weights.values()) > sum(w.size for w in zoo.weights.values())


def test_each_original_query_head_keeps_its_kv_head():
    slots = head_slots(num_heads=8, num_kv=4, new_kv=8, new_heads=32)
    assert slots.tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert (slots // (32 // 8)).tolist() == [i // 2 for i in range(8)]


@pytest.mark.parametrize("hidden,inter,kv,flag", [(200, 1024, 4, "--hidden"), (384, 512, 4, "--intermediate"),
                                                  (384, 1024, 8, "--kv-heads"), (384, 1024, 2, "--kv-heads")])
def test_a_widening_that_would_drop_a_head_or_channel_is_refused_naming_the_flag(hidden, inter, kv, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: got"):
        widen({}, {"hidden_size": 256, "intermediate_size": 768, "head_dim": 32, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "rms_norm_eps": 1e-5}, hidden, inter, kv)


def test_a_bundle_directory_that_would_be_replaced_is_refused_before_the_standin_is_written(tmp_path, capsys):
    from runtime.cli import main

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.yaml").write_text("format_version: 1\nfiles: {}\n")  # an edgespec bundle already there
    out = tmp_path / "standin"
    code = main(["zoo", "standin", "--out", str(out), "--bundle", str(bundle)])
    err = capsys.readouterr().err
    assert code == 2 and f"--bundle {bundle} already holds a bundle; pass --force" in err, err
    assert not out.exists()  # refused first: nothing written, no minutes spent
