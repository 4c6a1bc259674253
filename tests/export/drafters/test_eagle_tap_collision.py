"""Training an EAGLE-3 head warns, in one line naming the tap layers and the target's depth, when its default
tap layers (the inputs of layers 2, N//2 and N-3) repeat a layer: a 4-layer target gives [2, 2, 1], so the
head fuses two distinct layers, not three. A target deep enough for three distinct taps, and EAGLE-1 (which
reads only the final-normed state), train without it."""
import pytest
import torch

from export.drafters.eagle import tap_collision
from export.drafters.eagle_train import EagleTask
from export.zoo.model import LlamaConfig, LlamaLM


def target(layers: int) -> LlamaLM:
    torch.manual_seed(0)
    return LlamaLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()


def test_eagle3_training_on_a_4_layer_target_warns_in_one_line_that_its_tap_layers_repeat(capsys):
    task = EagleTask("eagle3", target(4), unroll=2)
    err = capsys.readouterr().err
    assert task.tap_layers == [2, 2, 1]
    lines = [line for line in err.splitlines() if "tap layers" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("warning: eagle3: tap layers [2, 2, 1] of a 4-layer target repeat layer 2"), lines[0]
    assert "2 distinct target layers, not 3" in lines[0]


@pytest.mark.parametrize("kind,layers", [("eagle3", 8), ("eagle", 4)])
def test_training_with_distinct_taps_or_eagle1_gives_no_tap_warning(capsys, kind, layers):
    EagleTask(kind, target(layers), unroll=2)
    assert "tap layers" not in capsys.readouterr().err


def test_tap_collision_names_every_repeated_layer_and_none_when_all_differ():
    assert tap_collision([2, 4, 5], 8) is None
    assert tap_collision([2, 1, 0], 3) is None
    assert "repeat layer 2:" in tap_collision([2, 2, 2], 5) and "1 distinct target layers" in tap_collision([2, 2, 2], 5)
    assert "repeat layer 3:" in tap_collision([2, 3, 3], 6)
