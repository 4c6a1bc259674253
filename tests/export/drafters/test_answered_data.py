"""`train-drafter --zoo-data answers` (export/drafters/data.py): the zoo domains' prompts, rendered in the target's
own prompt format as the bundle renders requests, each answered by the target itself (the first answer greedy,
the rest sampled at T = 1), so a drafter learns the text it will be asked to guess; every 20th prompt is held
out with all its answers."""
import numpy as np
import pytest

from export.bundle.prompts import bundle_prompts
from export.drafters import data as data_mod
from export.drafters.data import build_answered_data, zoo_prompts
from export.drafters.target import eos_ids, load_target
from export.drafters.user_data import continue_prompt
from runtime.text.tokenizer import Tokenizer
from tests.support.hf_targets import save_target


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = save_target(str(tmp_path_factory.mktemp("t")), "qwen3")
    return path, load_target(path), Tokenizer(path + "/tokenizer.json")


def test_each_zoo_prompt_is_answered_by_the_target_and_held_out_whole(tmp_path, qwen3):
    path, target, tok = qwen3
    data = build_answered_data(path, target, str(tmp_path), seed=1, n_planner=40, n_action=20, n_text=0, samples=2,
                               max_new=5, log=lambda _m: None)
    assert sorted(data) == ["action_heldout", "action_train", "planner_heldout", "planner_train"]
    fmt = bundle_prompts(path, tok)[0]
    encoded = [tok.encode(t) for t in zoo_prompts(fmt, 1, 40, 20, 0)["planner"]]
    prompts = [p for p in encoded if len(p) < target.cfg.max_position_embeddings]  # longer ones have no room
    assert "You are the task planner" in zoo_prompts(fmt, 1, 1, 0, 0)["planner"][0]  # the target's own template
    train, held = [r.tolist() for r in data["planner_train"]], [r.tolist() for r in data["planner_heldout"]]
    n = len(prompts)
    assert 20 <= n and len(train) == 2 * (n - 1) and len(held) == 2  # prompt 19 held out, with both answers
    eos = set(eos_ids(path))
    greedy = prompts[0] + continue_prompt(target, prompts[0], 5, eos)
    assert train[0] == greedy and train[1][:len(prompts[0])] == prompts[0]  # its sampled answer follows it
    assert [r[:len(prompts[19])] for r in held] == [prompts[19]] * 2
    assert all(r[:len(prompts[19])] != prompts[19] for r in train)  # none of its answers trains
    assert all(any(r[:len(p)] == p for p in prompts) for r in train)


def test_the_answers_are_written_once_and_read_back(tmp_path, qwen3, monkeypatch):
    path, target, _ = qwen3
    first = build_answered_data(path, target, str(tmp_path), 1, 20, 0, 0, 1, 4, log=lambda _m: None)
    import export.drafters.user_data as ud

    monkeypatch.setattr(ud, "continue_prompts", lambda *a, **k: pytest.fail("answered again"))
    again = build_answered_data(path, target, str(tmp_path), 1, 20, 0, 0, 1, 4, log=lambda _m: None)
    assert {k: [r.tolist() for r in v] for k, v in again.items()} == {k: [r.tolist() for r in v]
                                                                      for k, v in first.items()}
    assert data_mod.DOMAINS == ("planner", "action", "text")


def test_train_drafter_distils_on_the_targets_answers(tmp_path, qwen3, capsys):
    from runtime.cli import main
    from tests.export.drafters.test_any_target import TINY

    path = qwen3[0]
    argv = ["train-drafter", "eagle1", "--target", path, "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
            "--cache-dir", str(tmp_path / "c"), "--zoo-data", "answers", "--zoo-examples", "12",
            "--zoo-domains", "planner,action", "--gen-tokens", "6"] + TINY
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "zoo planner prompts answered by the target" in out and "zoo action prompts answered" in out
    assert main(argv + ["--force", "--data", str(tmp_path / "d.jsonl")]) == 2
    assert "--zoo-data answers: the zoo's domains are not used with --data" in capsys.readouterr().err
