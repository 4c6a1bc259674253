"""Zoo training puts its gradient where the planner must copy: prompt tokens weigh less, plan argument values more."""
import pytest
import torch
from tokenizers import Tokenizer, models

from export.zoo.loss_weights import SEP_ID, ValueMarkers, token_weights, value_mask


def _tok():
    words = ['[{"', 'skill', '":"', 'pick', '","', 'object', 'red', 'Ġ', 'cup', '"}]', '":', '5', '},{"', 'wait',
             'seconds', 'To', 'be']
    vocab = {f"<s{i}>": i for i in range(SEP_ID + 1)}
    vocab.update({w: len(vocab) + i for i, w in enumerate(words)})
    return Tokenizer(models.WordLevel(vocab, unk_token="<s0>")), vocab


def test_value_mask_marks_the_tokens_of_each_argument_value():
    _, v = _tok()
    markers = ValueMarkers.from_tokenizer(_tok()[0])
    toks = ['[{"', 'skill', '":"', 'pick', '","', 'object', '":"', 'red', 'Ġ', 'cup', '"}]']
    ids = torch.tensor([[v[t] for t in toks]])
    assert value_mask(ids, markers)[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0]
    toks = ['[{"', 'skill', '":"', 'wait', '","', 'seconds', '":', '5', '},{"']  # a number value
    ids = torch.tensor([[v[t] for t in toks]])
    assert value_mask(ids, markers)[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0]


def test_weights_prompt_answer_values_and_prose():
    _, v = _tok()
    markers = ValueMarkers.from_tokenizer(_tok()[0])
    plan = [1, 3, v['red'], SEP_ID, v['[{"'], v['object'], v['":"'], v['red'], v['"}]'], 2]
    prose = [1, 6, v['To'], v['be'], v['":"'], v['red']]  # no SEP: all answer, never an argument
    ids = torch.tensor([plan + prose])
    doc = torch.tensor([[0] * len(plan) + [1] * len(prose)])
    w = [round(x, 6) for x in token_weights(ids, doc, prompt_weight=0.3, value_weight=4.0, markers=markers)[0].tolist()]
    assert w[:4] == [0.3] * 4  # prompt up to and including SEP (the 'red' in the instruction is not an argument)
    assert w[4:10] == [1, 1, 1, 4, 1, 4]  # the argument value and the answer's EOS (the stop) weigh 4
    assert w[10:] == [1] * len(prose)
    # value_weight 1 gives the plain prompt/answer weights
    w1 = token_weights(ids, doc, 0.3, 1.0, markers)[0].tolist()
    assert w1[4:10] == [1] * 6


def test_markers_need_the_json_value_opener():
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    with pytest.raises(ValueError, match='":"'):
        ValueMarkers.from_tokenizer(tok)
