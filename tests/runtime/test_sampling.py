"""Sampling transforms on hand-checked examples, parameter validation, and the inverse-CDF sampler."""

import math

import numpy as np
import pytest

from runtime.errors import RequestError
from runtime.sampling import SamplingParams, process_logits, process_logits_batch, sample


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


LOGITS = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)


def test_temperature_one_is_plain_softmax():
    np.testing.assert_allclose(process_logits(LOGITS, SamplingParams(temperature=1.0)), softmax(LOGITS))


def test_temperature_divides_logits_before_softmax():
    got = process_logits(LOGITS, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(got, softmax(LOGITS / 0.5))


def test_output_is_float64_probabilities_summing_to_one():
    got = process_logits(LOGITS, SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05))
    assert got.dtype == np.float64 and got.shape == (4,)
    assert math.isclose(got.sum(), 1.0, rel_tol=1e-12)


def test_greedy_is_one_hot_at_argmax():
    np.testing.assert_array_equal(process_logits(LOGITS, SamplingParams()), [1, 0, 0, 0])
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


def test_greedy_ties_go_to_the_lowest_id():
    got = process_logits(np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32), SamplingParams())
    np.testing.assert_array_equal(got, [0, 1, 0, 0])


def test_top_k_keeps_the_k_largest_and_renormalises():
    got = process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(got, np.r_[softmax([2.0, 1.0]), 0, 0])


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    got = process_logits(np.array([2.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(got, np.r_[softmax([2.0, 1.0, 1.0]), 0])


def test_top_k_larger_than_vocab_is_a_no_op():
    np.testing.assert_allclose(process_logits(LOGITS, SamplingParams(temperature=1.0, top_k=99)), softmax(LOGITS))


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)),
                               [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.81)),
                               np.r_[[0.5, 0.3, 0.15], 0] / 0.95)


def test_top_p_always_keeps_the_most_probable_token():
    got = process_logits(np.log([0.7, 0.2, 0.1]), SamplingParams(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(got, [1, 0, 0])


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    got = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.1
    np.testing.assert_allclose(got, np.r_[[0.5, 0.3, 0.15], 0] / 0.95)


def test_transforms_apply_in_order_temperature_top_k_top_p_min_p():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # T=1, top-k 3 -> (4,3,2)/9; top-p 0.7 keeps 4/9+3/9 = 0.78 -> (4,3)/7; min-p 0.8 drops 3/7 < 0.8*4/7.
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7, min_p=0.8))
    np.testing.assert_allclose(got, [1, 0, 0, 0])
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    np.testing.assert_allclose(got, [4 / 7, 3 / 7, 0, 0])


def test_allowed_tokens_mask_everything_else():
    got = process_logits(LOGITS, SamplingParams(temperature=1.0, allowed_tokens=(1, 3)))
    np.testing.assert_allclose(got, [0, softmax([1.0, -1.0])[0], 0, softmax([1.0, -1.0])[1]])


def test_greedy_respects_allowed_tokens():
    np.testing.assert_array_equal(process_logits(LOGITS, SamplingParams(allowed_tokens=(2, 3))), [0, 0, 1, 0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    got = process_logits(LOGITS, params, history=[0, 3, 3])
    np.testing.assert_allclose(got, softmax([1.0, 1.0, 0.0, -2.0]))


def test_repetition_penalty_can_change_the_greedy_choice():
    got = process_logits(np.array([2.0, 1.5, 0.0]), SamplingParams(repetition_penalty=2.0), history=[0])
    np.testing.assert_array_equal(got, [0, 1, 0])


def test_repetition_penalty_one_ignores_history():
    params = SamplingParams(temperature=1.0)
    np.testing.assert_allclose(process_logits(LOGITS, params, history=[0, 1]), softmax(LOGITS))


def test_negative_infinite_logits_get_zero_probability():
    got = process_logits(np.array([-np.inf, 0.0, -np.inf, 0.0]), SamplingParams(temperature=1.0))
    np.testing.assert_allclose(got, [0, 0.5, 0, 0.5])


def test_huge_logits_and_tiny_temperature_stay_finite():
    logits = np.array([3e38, -3e38, 1e38, 0.0], dtype=np.float32)
    got = process_logits(logits, SamplingParams(temperature=1e-6))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, [1, 0, 0, 0])


def test_positive_infinite_logits_share_the_mass():
    got = process_logits(np.array([np.inf, 5.0, np.inf]), SamplingParams(temperature=1.0))
    np.testing.assert_allclose(got, [0.5, 0, 0.5])


def test_nan_logits_raise():
    with pytest.raises(ValueError, match="NaN"):
        process_logits(np.array([0.0, np.nan]), SamplingParams(temperature=1.0))


def test_all_tokens_masked_raises():
    with pytest.raises(ValueError, match="-inf"):
        process_logits(np.array([-np.inf, 0.0, 1.0]), SamplingParams(temperature=1.0, allowed_tokens=(0,)))


def test_batch_matches_row_by_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 3
    for params in [SamplingParams(), SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1)]:
        batch = process_logits_batch(logits, params, [])
        rows = np.stack([process_logits(row, params) for row in logits])
        np.testing.assert_allclose(batch, rows)


def test_batch_applies_each_rows_own_history():
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0)
    logits = np.tile(LOGITS, (2, 1))
    got = process_logits_batch(logits, params, [[0], [1]])
    np.testing.assert_allclose(got[0], process_logits(LOGITS, params, [0]))
    np.testing.assert_allclose(got[1], process_logits(LOGITS, params, [1]))
    with pytest.raises(ValueError, match="history"):
        process_logits_batch(logits, params, [[0]])


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=float("nan"))),
        ("temperature", dict(temperature=-0.5)),
        ("temperature", dict(temperature=float("inf"))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_p", dict(top_p=float("nan"))),
        ("top_p", dict(top_p=np.float32("nan"))),
        ("top_p", dict(top_p=-0.5)),  # never read as "off"
        ("top_p", dict(top_p=float("inf"))),
        ("top_p", dict(top_p="0.9")),
        ("min_p", dict(min_p=float("nan"))),
        ("min_p", dict(min_p=float("inf"))),
        ("repetition_penalty", dict(repetition_penalty=float("inf"))),
        ("top_k", dict(top_k=-1)),
        ("top_k", dict(top_k=2.5)),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.0)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("repetition_penalty", dict(repetition_penalty=-1.0)),
        ("repetition_penalty", dict(repetition_penalty=float("nan"))),
        ("allowed_tokens", dict(allowed_tokens=())),
        ("allowed_tokens", dict(allowed_tokens=(0, 10))),
        ("allowed_tokens", dict(allowed_tokens=(-1,))),
    ],
)
def test_bad_sampling_params_raise_request_error_naming_the_field(field, kwargs):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs).validate(vocab_size=10)
    assert info.value.field == field
    assert field in str(info.value)


def test_good_sampling_params_validate():
    SamplingParams().validate(10)
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.05, repetition_penalty=1.2,
                   allowed_tokens=(0, 9)).validate(10)


def test_sample_uses_one_draw_and_inverts_the_cdf():
    class Fixed:
        def __init__(self, u):
            self.u, self.calls = u, 0

        def random(self):
            self.calls += 1
            return self.u

    probs = np.array([0.2, 0.0, 0.8])
    for u, want in [(0.0, 0), (0.19, 0), (0.2, 2), (0.999999, 2)]:
        rng = Fixed(u)
        assert sample(probs, rng) == want
        assert rng.calls == 1


def test_sample_never_returns_a_zero_probability_token_at_the_end():
    class One:
        def random(self):
            return 1.0 - 1e-17  # rounds u * total up to the total

    assert sample(np.array([0.3, 0.7, 0.0]), One()) == 1


def test_sample_rejects_invalid_probabilities():
    rng = np.random.default_rng(0)
    for bad in ([0.0, 0.0], [-0.1, 1.1], [np.nan, 1.0]):
        with pytest.raises(ValueError):
            sample(np.array(bad), rng)


def test_greedy_batch_equals_the_general_path_ties_to_the_lowest_id():
    """The greedy rows skip the float64 copy; an all-True mask forces the general path for comparison."""
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 3, (7, 50)).astype(np.float32)  # many ties
    logits[2, :] = -np.inf
    logits[2, 9] = 0.0
    fast = process_logits_batch(logits, SamplingParams())
    general = process_logits_batch(logits, SamplingParams(), masks=np.ones(logits.shape, bool))
    np.testing.assert_array_equal(fast, general)
    assert fast.dtype == np.float64 and (fast.argmax(axis=1) == logits.argmax(axis=1)).all()


@pytest.mark.parametrize("bad, why", [(np.nan, "NaN"), (-np.inf, "-inf")])
def test_greedy_batch_refuses_a_nan_or_all_minus_inf_row(bad, why):
    logits = np.zeros((3, 8), np.float32)
    if bad != bad:  # NaN: one entry of a row is enough
        logits[1, 5] = bad
    else:
        logits[1, :] = bad
    with pytest.raises(ValueError, match=why):
        process_logits_batch(logits, SamplingParams())


def test_greedy_batch_allocates_one_vocab_by_rows_array():
    """Host work per cycle: the (N, V) logits become the (N, V) one-hot rows without a float64 copy of them or
    full-size boolean scans (each another N x V array)."""
    import tracemalloc

    logits = np.random.default_rng(1).standard_normal((8, 50_000)).astype(np.float32)
    tracemalloc.start()
    process_logits_batch(logits, SamplingParams())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.25 * logits.size * 8  # the float64 result itself, and little else


def test_greedy_choices_of_one_row_equal_the_rows_own_in_a_batch_and_refuse_nan_and_all_minus_inf():
    from runtime.sampling import greedy_choices

    rows = np.array([[1.0, 3.0, 3.0, -2.0], [0.0, -1.0, 2.0, 2.0]], np.float32)
    for i in range(2):  # one row (a plain step) and the same row in a batch: the same choice, ties -> lowest id
        assert greedy_choices(rows[i:i + 1]).tolist() == [greedy_choices(rows)[i]] == [[1, 2][i]]
    assert greedy_choices(rows[:1]).dtype == np.int64
    with pytest.raises(ValueError, match="NaN"):
        greedy_choices(np.array([[0.0, np.nan, 1.0]], np.float32))
    with pytest.raises(ValueError, match="-inf"):
        greedy_choices(np.full((1, 3), -np.inf, np.float32))
