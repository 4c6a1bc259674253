"""`--data FILE` rows (export/drafters/user_data.py): each example rendered with the target's own chat template as
the bundle renders a request, then answered by the target itself (greedy first, then sampled), its trailing
assistant turn dropped; with --keep-answers a chat ending in an answer is kept as given."""
import numpy as np
import pytest
import torch

from export.bundle.prompts import bundle_prompts
from export.drafters.target import eos_ids, load_target
from export.drafters.user_data import build_user_data, continue_prompt, continue_prompts
from runtime.text.tokenizer import Tokenizer
from tests.support.hf_targets import save_target

CHAT = [{"role": "user", "content": "bring me the red cup"}, {"role": "assistant", "content": "planning it now"}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = save_target(str(tmp_path_factory.mktemp("t")), "qwen3")
    tok = Tokenizer(path + "/tokenizer.json")
    return path, load_target(path), tok, bundle_prompts(path, tok)[0]


def write(tmp_path, lines):
    import json

    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(tmp_path / "d.jsonl")


def test_the_target_answers_each_prompt_through_its_chat_template(tmp_path, qwen3):
    path, target, tok, fmt = qwen3
    data = build_user_data(path, target, write(tmp_path, [{"messages": CHAT}, {"prompt": "pick up the box"}]),
                           str(tmp_path / "w"), seed=1, samples=2, max_new=6, log=lambda _m: None)
    prompt = tok.encode(fmt.render_chat(CHAT[:1], add_generation_prompt=True))  # the answer in the file is dropped
    assert "<|im_start|>assistant\n" in fmt.render_chat(CHAT[:1]) and len(data["data_train"]) == 2
    greedy, sampled = data["data_train"]
    assert greedy[:len(prompt)].tolist() == prompt and sampled[:len(prompt)].tolist() == prompt
    assert greedy[len(prompt):].tolist() == continue_prompt(target, prompt, 6, set(eos_ids(path)))
    assert len(data["data_heldout"]) == 2  # fewer than 20 prompts: the last one is held out


def test_keep_answers_trains_on_the_chat_as_given(tmp_path, qwen3):
    path, target, tok, fmt = qwen3
    data = build_user_data(path, target, write(tmp_path, [{"messages": CHAT}]), str(tmp_path / "w"), seed=1,
                           samples=2, max_new=6, log=lambda _m: None, keep_answers=True)
    assert [x.tolist() for x in data["data_train"]] == [tok.encode(fmt.render_chat(CHAT, add_generation_prompt=False))]


def test_greedy_continuation_is_the_targets_argmax_at_each_step(qwen3):
    _, target, _, _ = qwen3
    out = continue_prompt(target, [5, 9, 14], 4, eos=())
    seq = [5, 9, 14] + out
    with torch.no_grad():
        logits, _ = target(torch.tensor([seq]))
    assert out == logits[0, 2:-1].argmax(-1).tolist()


def test_batched_answers_are_the_answers_each_prompt_gets_alone(qwen3):
    """Prompts of different lengths share a batch (left-padded): each row's greedy answer is the one it gets on its
    own, each stops at its own limit or at an EOS token (kept), in the prompts' order."""
    _, target, _, _ = qwen3
    prompts = [[5, 9, 14], [7], [3, 4, 5, 6, 7, 8, 9], [11, 12], [5, 9, 14]]
    limits = [6, 3, 5, 1, 6]
    alone = [continue_prompt(target, p, n, eos=()) for p, n in zip(prompts, limits)]
    assert continue_prompts(target, prompts, limits, eos=(), batch=3) == alone
    stop = alone[2][2]  # make a token the third prompt writes an EOS: its answer ends there
    got = continue_prompts(target, prompts, limits, eos={stop}, batch=8)
    for row, want in zip(got, alone):
        assert row == (want[:want.index(stop) + 1] if stop in want else want)


def test_sampled_batched_answers_follow_the_seed(qwen3):
    _, target, _, _ = qwen3
    prompts = [[5, 9, 14], [7], [3, 4, 5, 6]]
    a = continue_prompts(target, prompts, [8, 8, 8], eos=(), seed=3)
    assert a == continue_prompts(target, prompts, [8, 8, 8], eos=(), seed=3)
    assert a != continue_prompts(target, prompts, [8, 8, 8], eos=(), seed=4)
    assert [len(x) for x in a] == [8, 8, 8] and a != continue_prompts(target, prompts, [8, 8, 8], eos=())
