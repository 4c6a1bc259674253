"""runtime/text/prompts.py: the prompt templates and the plan parser are the contract between training and run time."""
import pytest

from runtime.errors import RequestError
from runtime.text.prompts import (ACTION_TOKENS, BOS, CTX, EOS, OBS, PLAN, SEP, SPECIAL_TOKENS, action_prompt,
                             parse_plan, plan_objects, plan_to_json, planner_prompt)


def test_planner_prompt_has_markers_in_order_and_optional_context():
    assert planner_prompt("bring me the cup") == f"{BOS}{PLAN}bring me the cup{SEP}"
    p = planner_prompt("bring me the cup", "failed x: not found")
    assert p == f"{BOS}{PLAN}bring me the cup{CTX}failed x: not found{SEP}"


def test_action_prompt_formats_observation_with_two_decimals():
    p = action_prompt("pick up the cup", [0.1, -0.2, 0.3, 0.0, 1.0, 0.4, 0.1, 0.02])
    assert p == f"{BOS}<|act|>pick up the cup{OBS}+0.10 -0.20 +0.30 +0.00 +1.00 +0.40 +0.10 +0.02{SEP}"


def test_action_prompt_rejects_wrong_observation_length_and_empty_instruction():
    with pytest.raises(RequestError) as e:
        action_prompt("pick", [0.0, 1.0])
    assert e.value.field == "observation"
    with pytest.raises(RequestError):
        planner_prompt("   ")


def test_special_tokens_are_unique_and_include_256_action_bins():
    assert len(set(SPECIAL_TOKENS)) == len(SPECIAL_TOKENS)
    assert len(ACTION_TOKENS) == 256 and ACTION_TOKENS[0] == "<|a000|>" and ACTION_TOKENS[-1] == "<|a255|>"


def test_parse_plan_accepts_a_valid_plan_and_strips_eos():
    steps = [{"skill": "navigate", "room": "kitchen"}, {"skill": "pick", "object": "red cup"}]
    assert parse_plan(plan_to_json(steps) + EOS + "junk") == steps
    assert plan_objects(steps) == {"red cup"}


@pytest.mark.parametrize("text, fragment", [
    ('[{"skill":"pick"', "not valid JSON"),
    ("[]", "non-empty"),
    ('[{"room":"kitchen"}]', "'skill'"),
    ('[{"skill":"fly","to":"moon"}]', "unknown skill"),
    ('[{"skill":"place","object":"cup"}]', "lacks argument"),
    ('[{"skill":"pick","object":"cup","object":"knife"}]', "repeats the key 'object'"),
    ('[{"skill":"pick","skill":"place","object":"cup","target":"table"}]', "repeats the key 'skill'"),
    ('[{"skill":"pick","object":"cup","count":"3"}]', "count '3'; a count is an integer >= 1"),
    ('[{"skill":"pick","object":"cup","count":0}]', "count 0"),
    ('[{"skill":"pick","object":"cup","count":true}]', "count True"),
    ('[{"skill":"pick","object":"cup","count":2.5}]', "count 2.5"),
])
def test_parse_plan_names_the_problem(text, fragment):
    """Duplicate keys would otherwise keep the last value silently; a count must be a positive integer."""
    with pytest.raises(RequestError) as e:
        parse_plan(text)
    assert e.value.field == "plan" and fragment in str(e.value)


def test_parse_plan_accepts_an_integer_count():
    steps = [{"skill": "pick", "object": "cup", "count": 3}]
    assert parse_plan(plan_to_json(steps)) == steps
