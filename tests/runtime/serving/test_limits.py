"""Specification of a request's size limits and of which field a too-long prompt is blamed on."""
from __future__ import annotations

from dataclasses import replace

import pytest

from runtime.drafters import registry
from runtime.errors import BudgetExceeded, RequestError
from runtime.serving.limits import RequestLimits
from runtime.serving.session import GenerationParams, Session


def test_each_text_field_is_refused_over_its_limit_naming_the_field_and_the_parameter():
    limits = RequestLimits(instruction_chars=10, context_chars=20, prompt_chars=30, schema_chars=40)
    for field, limit in (("instruction", 10), ("context", 20), ("observation", 20), ("observation_text", 20),
                         ("prompt", 30), ("schema", 40)):
        limits.check({field: "x" * limit})  # at the limit: accepted
        with pytest.raises(RequestError, match=f"at most {limit} .*max_") as exc:
            limits.check({"instruction": "ok", field: "x" * (limit + 1)})
        assert exc.value.field == field


@pytest.fixture(scope="module")
def small_context(tiny_bundle):
    s = Session.open(tiny_bundle, drafter="none", max_context=64)
    yield s
    s.close()


@pytest.mark.parametrize("field", ["instruction", "context", "observation"])
def test_a_plan_too_long_for_the_context_names_its_longest_field_not_prompt(small_context, field):
    values = {"instruction": "bring the cup", "context": "", "observation": "", field: "the red cup " * 40}
    with pytest.raises(RequestError, match="longest part of the prompt") as exc:
        small_context.plan(values["instruction"], values["context"], GenerationParams(max_tokens=4),
                           observation=values["observation"])
    assert exc.value.field == field


def test_a_context_the_template_alone_fills_names_the_instruction(tiny_bundle):
    s = Session.open(tiny_bundle, drafter="none", max_context=4)
    try:
        with pytest.raises(RequestError) as exc:
            s.plan("go", params=GenerationParams(max_tokens=1))
        assert exc.value.field == "instruction"
        with pytest.raises(RequestError) as exc:
            s.action_tokens("go", observation_text="cup ahead " * 5, num_actions=1)
        assert exc.value.field == "observation_text"
    finally:
        s.close()


def test_a_request_over_the_memory_budget_is_a_refused_request_naming_its_field(tiny_bundle):
    from runtime.config import RuntimeConfig
    from runtime.memory import plan as memory
    from runtime.model import bundle as bundle_io

    inp = registry.plan_inputs(bundle_io.load(tiny_bundle), "none", "numpy_ref", 1)
    cfg = RuntimeConfig(bundle=tiny_bundle)
    cfg = replace(cfg, drafter=replace(cfg.drafter, kind="none"),
                  memory=replace(cfg.memory, budget_mb=memory.budget_needed(inp, 200) / 2**20))
    s = Session(cfg)
    try:
        assert s.budget_positions is not None
        with pytest.raises(RequestError) as exc:
            s.plan("the red cup " * 200, params=GenerationParams(max_tokens=4))
        assert exc.value.field == "instruction" and isinstance(exc.value, BudgetExceeded)
    finally:
        s.close()
