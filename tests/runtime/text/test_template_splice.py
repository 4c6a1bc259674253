"""runtime/text/templates.py: a raw task template that only prints its values and tests them for emptiness
renders once per shape (which values are empty) and splices each request's values in; the text and the
spans of request text are exactly those of rendering it with Jinja, and a template that transforms or
compares a value is never spliced."""
from __future__ import annotations

import random

import pytest

from runtime.text.prompts import ZOO_PROMPTS, action_request, planner_request
from runtime.text.templates import PromptFormat, TaskTemplate, splices_values


@pytest.mark.parametrize("source, spliced", [
    ("<|bos|><|plan|>{{ instruction }}{% if context %}<|ctx|>{{ context }}{% endif %}<|sep|>", True),
    ("{{ bos_token }}{% if not context %}none{% elif context %}[{{ context }}]{% endif %}{{ instruction }}", True),
    ("{{ instruction | trim }}", False),  # a filter changes the value
    ("{% if instruction == 'stop' %}halt{% endif %}{{ instruction }}", False),  # a comparison reads it
    ("{{ instruction.upper() }}", False),
    ("{{ instruction ~ '!' }}", False),
    ("{% set a = instruction %}{{ a }}", False),
    ("{% for c in instruction %}{{ c }}{% endfor %}", False),
    ("{{ instruction[0] }}", False),
])
def test_only_templates_that_print_and_truth_test_their_values_are_spliced(source, spliced):
    assert splices_values(source) is spliced


def _values(rng):
    words = ["bring", "the", "cup", "<|sep|>", "{{ x }}", "\ue0000\ue001", "  ", "ü", "\n", "{% if %}"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) if rng.random() < 0.8 else ""


def test_a_spliced_prompt_equals_the_jinja_rendering_for_any_values_and_keeps_the_request_spans():
    rng = random.Random(0)
    for _ in range(200):
        instruction, context = _values(rng).strip() or "go", _values(rng)
        fresh = PromptFormat(tasks=ZOO_PROMPTS.tasks, special_tokens=ZOO_PROMPTS.special_tokens, source="fresh")
        got = planner_request(instruction, context, ZOO_PROMPTS)  # the cached shape, after the first of its kind
        assert got.text == fresh.render("planner", instruction=instruction.strip(), context=context.strip())
        assert got == planner_request(instruction, context, fresh) and got.exact
        for (start, end), (_, value) in zip(got.user_spans, [v for v in got.values if v[1]]):
            assert got.text[start:end] == value
    assert len(ZOO_PROMPTS._marked) <= 4  # one marked text per task and shape, not per request


def test_a_transforming_template_still_renders_with_jinja_every_time():
    fmt = PromptFormat(tasks={"planner": TaskTemplate(raw="<|bos|>{{ instruction | upper }}<|sep|>")}, source="t")
    assert planner_request("go there", "", fmt).text == "<|bos|>GO THERE<|sep|>"
    assert planner_request("come back", "", fmt).text == "<|bos|>COME BACK<|sep|>"
    assert not fmt._marked


def test_the_observation_of_an_action_request_is_spliced_as_text():
    got = action_request("pick up the cup", [0.1, -0.2, 0.3, 0.0, 1.0, 0.4, 0.1, 0.02], ZOO_PROMPTS)
    again = action_request("pick up the cup", [0.5, -0.2, 0.3, 0.0, 1.0, 0.4, 0.1, 0.02], ZOO_PROMPTS)
    assert again.text == got.text.replace("+0.10", "+0.50", 1)
