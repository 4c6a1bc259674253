"""`--data FILE` rows (export/drafters/user_data.py): each example rendered with the target's own chat template as
the bundle renders a request, then answered by the target itself (greedy first, then sampled), its trailing
assistant turn dropped; with --keep-answers a chat ending in an answer is kept as given."""
import numpy as np
import pytest
import torch

from export.bundle.prompts import bundle_prompts
from export.drafters.target import eos_ids, load_target
from export.drafters.user_data import build_user_data, continue_prompt
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
