"""runtime/text/actions.py: RT-2 style action binning must round-trip within half a bin and reject malformed input."""
import numpy as np
import pytest

from runtime.text.actions import DEFAULT_HIGH, DEFAULT_LOW, ActionTokenizer
from runtime.errors import RequestError
from runtime.text.prompts import ACTION_TOKENS

IDS = tuple(range(1000, 1256))


def test_encode_decode_round_trip_error_is_at_most_half_a_bin():
    at = ActionTokenizer(IDS)
    rng = np.random.default_rng(0)
    low, high = np.array(DEFAULT_LOW), np.array(DEFAULT_HIGH)
    a = rng.uniform(low, high, size=(500, 7))
    back = at.decode(at.encode(a))
    assert back.dtype == np.float32 and back.shape == (500, 7)
    half_bin = (high - low) / 256 / 2
    assert np.all(np.abs(back - a) <= half_bin + 1e-6)


def test_out_of_range_values_clip_to_the_end_bins():
    at = ActionTokenizer(IDS)
    ids = at.encode([[-9, 9, 0, 0, 0, 0, 2.0]])
    assert ids[0] == IDS[0] and ids[1] == IDS[255] and ids[6] == IDS[255]


def test_wrong_shapes_and_foreign_tokens_raise_request_error():
    at = ActionTokenizer(IDS)
    with pytest.raises(RequestError):
        at.encode(np.zeros((2, 6)))
    with pytest.raises(RequestError):
        at.decode(list(IDS[:8]))  # not a multiple of 7
    with pytest.raises(RequestError):
        at.decode([5] * 7)  # not an action token
    with pytest.raises(RequestError):
        ActionTokenizer(IDS[:10])


def test_allowed_token_ids_are_exactly_the_bin_tokens():
    at = ActionTokenizer(IDS)
    assert list(at.allowed_token_ids()) == list(IDS)
    assert at.is_action_token(1000) and not at.is_action_token(999)


def test_from_tokenizer_looks_bins_up_by_string():
    class Fake:
        def token_to_id(self, s):
            return 9 + ACTION_TOKENS.index(s)

    at = ActionTokenizer.from_tokenizer(Fake())
    assert at.token_ids[0] == 9 and at.token_ids[255] == 264


def test_a_model_without_action_tokens_is_told_so_and_what_a_model_needs_for_them():
    class NoBins:
        def token_to_id(self, s):
            return None

    with pytest.raises(RequestError) as err:
        ActionTokenizer.from_tokenizer(NoBins())
    msg = str(err.value)
    assert "this model has no action tokens" in msg and "<|a000|> .. <|a255|>" in msg, msg
    assert "trained to emit them" in msg and "was it built" not in msg, msg
