"""export/zoo data generators and tokenizer: deterministic, valid, learnable, and consistent with the runtime."""
import json
import random

import numpy as np
import pytest

from export.zoo.action_data import action_text, generate_action_examples, to_bins
from export.zoo.planner_data import NOUNS, generate_planner_examples, split_planner
from export.zoo.tokenizer import strip_specials, train_tokenizer
from runtime.text.actions import DEFAULT_HIGH, DEFAULT_LOW, ActionTokenizer
from runtime.text.prompts import ACTION_CHUNK, EOS, SEP, SKILLS, SPECIAL_TOKENS, parse_plan, plan_objects


def test_planner_generator_is_deterministic_from_its_seed():
    assert generate_planner_examples(7, 50) == generate_planner_examples(7, 50)
    assert generate_planner_examples(7, 50) != generate_planner_examples(8, 50)


def test_every_generated_plan_parses_and_names_objects_from_the_instruction():
    for ex in generate_planner_examples(3, 2000):
        steps = parse_plan(ex.answer)
        assert steps == list(ex.plan)
        assert ex.answer.endswith(EOS) and ex.prompt.endswith(SEP)
        text = ex.instruction + " " + ex.context
        for obj in plan_objects(steps):
            noun = obj.split()[-1]
            assert noun in text or NOUNS.get(noun, "#") in text, (obj, text)


def test_planner_data_has_variety():
    exs = generate_planner_examples(5, 3000)
    skills = {s["skill"] for e in exs for s in e.plan}
    assert skills == set(SKILLS)
    assert sum(bool(e.context) for e in exs) > 300  # replanning after a reported failure
    assert sum(any("count" in s for s in e.plan) for e in exs) > 100  # quantities
    assert len({e.instruction for e in exs}) > 2900
    assert max(len(e.plan) for e in exs) >= 10  # multi-goal instructions


def test_heldout_planner_instructions_never_occur_in_training():
    train, held = split_planner(1, 3000, 200)
    assert len(held) == 200
    assert not {(e.instruction, e.context) for e in held} & {(e.instruction, e.context) for e in train}


def test_action_chunks_are_in_range_smooth_and_deterministic():
    exs = generate_action_examples(11, 400)
    assert exs == generate_action_examples(11, 400)
    low, high = np.array(DEFAULT_LOW), np.array(DEFAULT_HIGH)
    jumps = []
    for ex in exs:
        a = np.asarray(ex.actions)
        assert a.shape == (ACTION_CHUNK, 7)
        # within the range up to the controller noise (the binning clips that last millimetre)
        assert np.all(a >= low - 0.01) and np.all(a <= high + 0.01)
        jumps.append(np.abs(np.diff(a[:, :3], axis=0)).ravel())
        assert set(np.unique(a[:, 6])) <= {0.0, 1.0}
    # a saturated P-controller with small noise: consecutive translations are close except at waypoint switches
    jumps = np.concatenate(jumps)
    assert np.percentile(jumps, 95) < 0.02 and jumps.max() <= 0.1


def test_action_bins_match_the_runtime_action_tokenizer():
    at = ActionTokenizer(tuple(range(9, 265)))
    ex = generate_action_examples(2, 1)[0]
    assert list(at.encode(ex.actions) - 9) == list(to_bins(ex.actions))


@pytest.fixture(scope="module")
def tok():
    corpus = [strip_specials(e.text) for e in generate_planner_examples(1, 300)]
    corpus += [strip_specials(action_text(e)) for e in generate_action_examples(1, 100)]
    corpus += ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate."] * 20
    return train_tokenizer(corpus, 700)


def test_tokenizer_gives_specials_fixed_ids_and_never_splits_action_tokens(tok):
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    ex = generate_action_examples(4, 1)[0]
    ids = tok.encode(action_text(ex)).ids
    at = ActionTokenizer.from_tokenizer(tok)
    action_ids = [t for t in ids if at.is_action_token(t)]
    assert len(action_ids) == ACTION_CHUNK * 7 and ids[-1] == tok.token_to_id(EOS)
    half_bin = (np.array(DEFAULT_HIGH) - np.array(DEFAULT_LOW)) / 256 / 2
    clipped = np.clip(np.asarray(ex.actions), DEFAULT_LOW, DEFAULT_HIGH)
    assert np.all(np.abs(at.decode(action_ids) - clipped) <= half_bin + 1e-6)


def test_tokenizer_round_trips_plans_exactly(tok):
    ex = generate_planner_examples(9, 1)[0]
    ids = tok.encode(ex.text).ids
    sep = ids.index(tok.token_to_id(SEP))
    answer = tok.decode(ids[sep + 1:], skip_special_tokens=True)
    assert json.loads(answer) == list(ex.plan)


def test_a_word_is_the_same_tokens_in_the_instruction_and_in_the_plan(tok):
    # The planner copies rooms and objects from the instruction into the JSON; with a space glued to the word
    # ("Ġkitchen" vs "kitchen" after a quote) it would have to learn a mapping instead.
    for word in ("kitchen", "living room", "red cup", "Alice"):
        after_space = tok.encode(f"go to the {word}").tokens
        in_json = tok.encode(f'{{"room":"{word}"}}').tokens
        n = len(tok.encode(word).tokens)
        assert after_space[-n:] == tok.encode(word).tokens
        assert tok.encode(word).tokens == in_json[-n - 1:-1]


def test_tokenizer_round_trips_every_domain_with_specials(tok):
    texts = [e.text for e in generate_planner_examples(11, 20)]
    texts += [action_text(e) for e in generate_action_examples(11, 5)]
    texts += [f"<|bos|><|text|>Shall I compare thee  to a summer's day?\n\tThou art -- more lovely.<|eos|>"]
    for text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
