"""The session API the CLI and the ROS node use: planner, action-token and free requests on a bundle,
with every bad input rejected as a RequestError naming the field before any work starts."""
import math

import numpy as np
import pytest

from runtime.errors import BundleError, RequestError
from runtime.text.prompts import OBS_DIMS
from runtime.serving.session import GenerationParams, Session

OBS = [0.1] * OBS_DIMS


@pytest.fixture(scope="module")
def session(tiny_bundle):
    return Session.open(tiny_bundle, drafter="draft_model", max_context=256)


def test_action_request_returns_exactly_the_asked_actions_all_in_range(session):
    res = session.action_tokens("pick up the red cup", OBS, num_actions=3, params=GenerationParams(temperature=1.0))
    assert res.actions.shape == (3, res.dims) and len(res.token_ids) == 3 * res.dims
    assert all(session.actions.is_action_token(t) for t in res.token_ids)  # the mask held on p and q
    low, high = np.array(session.actions.low), np.array(session.actions.high)
    assert ((res.actions >= low) & (res.actions <= high)).all()


def test_plan_request_reports_whether_the_plan_parses(session):
    res = session.plan("pick up the red cup", params=GenerationParams(max_tokens=12))
    assert res.plan_ok is False and res.plan_error  # random weights write no JSON; the error says why
    assert res.stats.tokens == 12


def test_stream_deltas_add_up_to_the_text(session):
    deltas = []
    res = session.generate("<|bos|><|text|>the robot", GenerationParams(max_tokens=16), on_delta=lambda d, n: deltas.append(d))
    assert "".join(deltas) == res.text


def test_a_request_without_a_stream_has_the_streams_text_decoded_once_at_the_end(session):
    params = GenerationParams(max_tokens=24)
    deltas = []
    streamed = session.generate("<|bos|><|text|>the robot", params, on_delta=lambda d, n: deltas.append(d))
    whole = session.generate("<|bos|><|text|>the robot", params)
    assert whole.text == streamed.text == "".join(deltas) and whole.token_ids == streamed.token_ids
    calls = []
    real = session.tokenizer.decode
    session.tokenizer.decode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        session.generate("<|bos|><|text|>the robot", params)
    finally:
        session.tokenizer.decode = real
    assert len(calls) == 1  # not once per token: that is quadratic in the answer's length


def test_a_failure_mid_request_without_a_stream_keeps_the_text_decoded_so_far(session, monkeypatch):
    ids = session.tokenizer.encode(" the robot moves")

    def failing(prompt_ids, sampling, max_tokens, seed, on_tokens, *args, **kwargs):
        on_tokens(list(ids))
        raise RuntimeError("backend died")

    monkeypatch.setattr(session.engine, "generate", failing)
    with pytest.raises(RuntimeError) as exc:
        session.generate("<|bos|><|text|>the robot", GenerationParams(max_tokens=24))
    assert exc.value.partial.token_ids == list(ids)
    assert exc.value.partial.text == session.tokenizer.decode(list(ids), skip_special_tokens=True) != ""


def test_cancel_is_polled_during_generation(session):
    res = session.generate("<|bos|><|text|>the robot", GenerationParams(max_tokens=64), should_stop=lambda: True)
    assert res.finish_reason == "cancelled" and res.stats.tokens <= 8


@pytest.mark.parametrize("call,field", [
    (lambda s: s.generate("", GenerationParams()), "prompt"),
    (lambda s: s.plan("   "), "instruction"),
    (lambda s: s.plan("go", params=GenerationParams(max_tokens=10_000)), "max_tokens"),
    (lambda s: s.plan("go", params=GenerationParams(temperature=math.nan)), "temperature"),
    (lambda s: s.plan("go", params=GenerationParams(deadline_s=-1)), "deadline_s"),
    (lambda s: s.action_tokens("pick", [0.1] * 3), "observation"),
    (lambda s: s.action_tokens("pick", [math.nan] * OBS_DIMS), "observation"),
    (lambda s: s.action_tokens("pick", [1e30] + [0.1] * (OBS_DIMS - 1)), "observation"),
    (lambda s: s.action_tokens("pick", OBS, observation_text="cup 0.4 m ahead"), "observation_text"),
    (lambda s: s.action_tokens("pick", OBS, num_actions=0), "num_actions"),
    (lambda s: s.generate("x" * 5000, GenerationParams()), "prompt"),
    (lambda s: s.generate("x" * 5000, GenerationParams(max_tokens=0)), "prompt"),
    (lambda s: s.generate("the robot", GenerationParams(max_tokens=0)), "max_tokens"),
    (lambda s: s.generate("the robot", GenerationParams(max_tokens=250)), "max_tokens"),
])
def test_bad_requests_name_the_field(session, call, field):
    with pytest.raises(RequestError) as err:
        call(session)
    assert err.value.field == field


def test_unknown_drafter_is_a_request_error(tiny_bundle):
    with pytest.raises(RequestError) as err:
        Session.open(tiny_bundle, drafter="telepathy")
    assert err.value.field == "drafter"


def test_a_drafter_the_bundle_lacks_lists_only_what_it_can_run_and_how_to_add_it(tiny_bundle, tmp_path):
    import shutil

    from runtime.model.bundle import BundleWriter

    root = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, root)
    w = BundleWriter.extend(root)
    del w.manifest["drafters"]["draft_model"]  # a bundle of the target alone: n-gram and plain decoding
    w.manifest["default_drafter"] = "none"
    w.write()
    with pytest.raises(RequestError) as err:
        Session.open(root, drafter="eagle3")
    msg = str(err.value)
    assert "it can run ['ngram', 'none']" in msg and "draft_model" not in msg, msg
    assert f"`edgespec bundle --target DIR --eagle3 DIR --out {root} --force`" in msg, msg
    assert "edgespec train-drafter eagle3" in msg, msg


def test_missing_bundle_is_a_bundle_error(tmp_path):
    with pytest.raises(BundleError, match="make bundles"):
        Session.open(str(tmp_path / "nope"))


@pytest.mark.parametrize("field,value", [
    ("top_p", math.nan), ("top_p", -0.5), ("top_p", 0.0), ("top_p", math.inf), ("top_p", 1.5),
    ("min_p", math.nan), ("min_p", -0.1), ("min_p", 1.0),
    ("temperature", math.nan), ("temperature", -1.0), ("temperature", math.inf),
    ("top_k", -1), ("top_k", 2.5),
    ("repetition_penalty", math.nan), ("repetition_penalty", 0.0), ("repetition_penalty", -math.inf),
])
def test_a_non_finite_or_out_of_range_sampling_value_is_refused_never_read_as_off(session, field, value):
    """top_p NaN or negative must not silently mean "off": refused, greedy or not, naming the field."""
    for temperature in (0.0, 0.7):
        params = GenerationParams(**{"temperature": temperature, "max_tokens": 4, field: value})
        with pytest.raises(RequestError) as err:
            session.generate("<|bos|><|text|>the robot", params)
        assert err.value.field == field


def test_the_plan_request_streams_its_text(session):
    deltas = []
    res = session.plan("pick up the red cup", params=GenerationParams(max_tokens=12),
                       on_delta=lambda d, n: deltas.append(d))
    assert deltas and "".join(deltas) == res.text


def test_the_default_backend_is_numpy_ref_when_the_bundle_has_no_onnx_graphs(tiny_bundle):
    assert Session.open(tiny_bundle, drafter="none", max_context=64).backend_name == "numpy_ref"


def test_session_open_takes_the_draft_shape_and_refuses_an_unknown_one_naming_drafter_shape(tiny_bundle):
    adaptive = Session.open(tiny_bundle, drafter="draft_model", max_context=256, shape="adaptive")
    fixed = Session.open(tiny_bundle, drafter="draft_model", max_context=256, shape="fixed")
    try:
        assert adaptive.shape.label.startswith("adaptive") and adaptive.engine.policy is not None
        assert fixed.shape.label == "fixed" and fixed.engine.policy is None
    finally:
        adaptive.close()
        fixed.close()
    with pytest.raises(BundleError, match="drafter.shape"):
        Session.open(tiny_bundle, drafter="draft_model", max_context=256, shape="diagonal")
