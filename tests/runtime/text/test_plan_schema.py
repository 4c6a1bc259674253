"""configs/plan_schema.json, enforced while decoding, makes every zoo plan one the executor can run.

The zoo target and draft model (the built zoo bundle) decode greedily with speculation under the schema.
Fast subset here: HELD_OUT prompts from the zoo's held-out planner stream and OOD of the 20 hand-written
out-of-distribution instructions of export/zoo/plans.py; `edgespec zoo plans --n 200` runs the full set
with and without the schema (numbers in BENCHMARKS.md)."""
from tests.support import REPO_ROOT
import copy
import os

import jsonschema
import numpy as np
import pytest

from export.zoo.planner_data import generate_planner_examples
from export.zoo.plans import OUT_OF_DISTRIBUTION, SCHEMA_PATH
from runtime.text.grammar import load_schema_file
from runtime.text.prompts import EOS, SKILLS
from runtime.serving.session import GenerationParams, Session

ROOT = REPO_ROOT
BUNDLE = os.path.join(ROOT, "build", "bundles", "zoo")
HELD_OUT = 6  # prompts of each set decoded here; `edgespec zoo plans` runs them all
OOD = 10
PARAMS = GenerationParams(max_tokens=200)


@pytest.fixture(scope="module")
def planner():
    """The built zoo bundle (`make test` builds it first) on its default backend, with and without a drafter."""
    if not os.path.isfile(os.path.join(BUNDLE, "bundle.yaml")):
        pytest.skip(f"{BUNDLE} is not built: run `make bundles`")
    sessions = {kind: Session.open(BUNDLE, drafter=kind) for kind in ("draft_model", "none")}
    schema = load_schema_file(SCHEMA_PATH)
    yield sessions, schema
    for s in sessions.values():
        s.close()


def test_the_schema_has_one_alternative_per_skill_with_the_runtimes_required_arguments():
    schema = load_schema_file(SCHEMA_PATH)
    jsonschema.Draft202012Validator.check_schema(schema)
    alternatives = {a["properties"]["skill"]["const"]: a for a in schema["items"]["anyOf"]}
    assert set(alternatives) == set(SKILLS)
    for skill, alt in alternatives.items():
        assert alt["required"] == ["skill", *SKILLS[skill]] and alt["additionalProperties"] is False


def test_every_plan_decoded_under_the_schema_parses_and_validates(planner):
    sessions, schema = planner
    validator = jsonschema.Draft202012Validator(schema)
    held = [(e.instruction, e.context) for e in generate_planner_examples(1234 * 1000 + 2, HELD_OUT)]
    cycles = tokens = 0
    for i, (instruction, context) in enumerate(held + [(s, "") for s in OUT_OF_DISTRIBUTION[:OOD]]):
        res = sessions["draft_model"].plan(instruction, context, PARAMS, schema=schema)
        assert res.finish_reason == "eos" and res.plan_ok, (res.text, res.plan_error)
        assert validator.is_valid(res.plan), (res.text, [e.message for e in validator.iter_errors(res.plan)])
        if i < 2:  # and the speculation changed nothing: constrained plain decoding gives the same text
            assert sessions["none"].plan(instruction, context, PARAMS, schema=schema).text == res.text
        cycles += res.stats.cycles
        tokens += res.stats.tokens
    assert tokens > 2.5 * cycles  # the drafter kept its speed on plans under the grammar


def test_the_duplicated_key_failure_cannot_be_decoded_under_the_schema(planner):
    """The out-of-distribution failure that motivated the schema: a step repeating its "object" key."""
    sessions, schema = planner
    session = sessions["none"]
    tok, state = session.tokenizer, session.grammar(schema).start()
    bad = tok.encode('[{"skill":"pick","object":"cup","object":"knife"}]')
    refused_at = next(i for i in range(len(bad) + 1) if i == len(bad) or not state.allowed(bad[:i])[bad[i]])
    assert refused_at < len(bad)
    assert tok.decode(bad[:refused_at]).startswith('[{"skill":"pick","object":"cup"')
    good = tok.encode('[{"skill":"pick","object":"cup"}]')
    assert all(state.allowed(good[:i])[good[i]] for i in range(len(good)))
    assert np.flatnonzero(state.allowed(good)).tolist() == [tok.token_to_id(EOS)]


def test_a_robot_restricts_plans_to_its_world_by_replacing_a_def_with_an_enum(planner):
    """The instruction names a garage; this robot's world model knows only a kitchen and an office."""
    sessions, schema = planner
    world = copy.deepcopy(schema)
    world["$defs"]["room"] = {"enum": ["kitchen", "office", "start"]}
    free = sessions["draft_model"].plan("bring me the red cup from the garage", params=PARAMS)
    res = sessions["draft_model"].plan("bring me the red cup from the garage", params=PARAMS, schema=world)
    assert "garage" in free.text  # what the model wants to write
    assert res.plan_ok and {s["room"] for s in res.plan if "room" in s} <= {"kitchen", "office", "start"}, res.text
