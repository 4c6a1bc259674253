"""onnxruntime-genai as a bench peer (export/peers/registry.py): a checkpoint its model builder is known to
convert wrongly is refused with the reason, before a build, so the bench shows a row saying why instead of a
peer that answers wrongly. The builder takes every Linear with vocab_size outputs for the LM head; the robot
stand-in once had a SwiGLU exactly as wide as the vocabulary (3072) and its peer's logits were a layer's."""
import json

import pytest

from export.peers.registry import (PeerModels, PeerUnavailable, build_ortgenai_model, builder_misreads, open_peer,
                                   thread_overlay)


def _checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_an_mlp_as_wide_as_the_vocabulary_is_refused_naming_both_fields(tmp_path):
    hf = _checkpoint(tmp_path, vocab_size=3072, intermediate_size=3072, hidden_size=512)
    with pytest.raises(PeerUnavailable, match="intermediate_size 3072 = vocab_size"):
        build_ortgenai_model(hf, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # refused before the builder ran


def test_the_bench_entry_point_turns_it_into_a_row_not_a_traceback(tmp_path):
    hf = _checkpoint(tmp_path, vocab_size=3072, intermediate_size=3072, hidden_size=512)
    models = PeerModels(target=hf, draft=None, eos_ids=(2,))
    with pytest.raises(PeerUnavailable, match="LM head"):
        open_peer("ortgenai", models, str(tmp_path / "cache"))


def test_other_widths_and_a_config_without_a_vocabulary_are_converted():
    assert builder_misreads({"vocab_size": 3072, "intermediate_size": 3200}) == ""
    assert builder_misreads({"intermediate_size": 3072}) == ""


def test_a_config_that_is_not_json_is_refused_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PeerUnavailable, match="config.json: cannot be read"):
        build_ortgenai_model(str(tmp_path), str(tmp_path / "cache"))


def test_the_peer_runs_on_edgespecs_thread_count(tmp_path):
    """A peer left to onnxruntime-genai's default took one thread on a 2-vCPU VM while edgespec used two."""
    og = pytest.importorskip("onnxruntime_genai")
    assert thread_overlay(3)["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 3
    assert "draft" not in thread_overlay(3)["model"]
    assert thread_overlay(0)["model"]["decoder"]["session_options"]["intra_op_num_threads"] >= 1
    # the overlay is one onnxruntime-genai accepts on a real config
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "llama", "vocab_size": 8, "context_length": 8,
        "decoder": {"filename": "model.onnx", "session_options": {}, "head_size": 4, "hidden_size": 8,
                    "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 1,
                    "inputs": {}, "outputs": {}}}, "search": {"max_length": 8}}))
    config = og.Config(str(folder))
    config.overlay(json.dumps(thread_overlay(2)))
