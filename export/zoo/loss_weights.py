"""Per-token loss weights for zoo training: where the gradient should go.

Three rules, all pure functions of the token ids of packed rows (B, T+1):
- prompt tokens (up to and including SEP) weigh `prompt_weight`: prompts are given at inference, so capacity
  goes to the answers;
- inside a planner answer, the argument values of the JSON plan (`"room":"kitchen"`, `"object":"red cup"`,
  `"count":2`) weigh `value_weight`. They are the few tokens the model must copy from the instruction; the rest of
  a plan is syntax it learns early. Without the extra weight a small model trained for half an hour learns the
  syntax and the most frequent nouns, and copies almost nothing;
- the EOS that ends an answer weighs `value_weight` too: it is the stop decision, and an action chunk must stop after
  exactly 8 x 7 tokens, which a model that sees fewer action examples otherwise miscounts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.text.prompts import EOS, SEP, SPECIAL_TOKENS

SEP_ID = SPECIAL_TOKENS.index(SEP)
EOS_ID = SPECIAL_TOKENS.index(EOS)


@dataclass(frozen=True)
class ValueMarkers:
    """Token ids that open a JSON value (`":"`, `":`) and ids that end one (any token holding `"`, `}` or `,`)."""

    opens: torch.Tensor
    closes: torch.Tensor

    @classmethod
    def from_tokenizer(cls, tok) -> "ValueMarkers":
        vocab = tok.get_vocab()
        opener_texts = ('":"', '":')
        opens = [vocab[t] for t in opener_texts if t in vocab]
        if not opens:
            raise ValueError('the tokenizer has no token for \'":"\' or \'":\'; plan arguments cannot be found')
        closes = [i for t, i in vocab.items() if t not in opener_texts and any(c in t for c in '"},')]
        return cls(torch.tensor(sorted(opens)), torch.tensor(sorted(closes)))


def prompt_and_answer(ids: torch.Tensor, doc: torch.Tensor):
    """-> (prompt, answer), each (B, T+1): `prompt` marks tokens up to and including the SEP of a document that holds
    one, `answer` the tokens after that SEP. Prose (a document without SEP) is in neither."""
    d = doc.clone()
    d[d < 0] = int(doc.max()) + 1  # padding: one more document (it has no labels anyway)
    onehot = F.one_hot(d, int(d.max()) + 1).bool()  # (B, T+1, n_docs)
    is_sep = ids == SEP_ID  # (B, T+1)
    seps = torch.cumsum((onehot & is_sep[..., None]).long(), dim=1)  # (B, T+1, n_docs) SEPs so far, per document
    seen = seps.gather(2, d[..., None])[..., 0] - is_sep.long()  # (B, T+1) SEPs strictly before, same document
    has = seps[:, -1].gather(1, d) > 0  # (B, T+1) the document holds a SEP
    return has & (seen == 0), has & (seen > 0)


def value_mask(ids: torch.Tensor, markers: ValueMarkers) -> torch.Tensor:
    """(B, T+1) True for tokens inside a JSON value: after an opener, before the next closer.

        tokens: [{"  skill  ":"  pick  ","  object  ":"  red  Ġ  cup  "}]
        mask:    0     0     0    1     0     0      0    1   1   1    0"""
    idx = torch.arange(ids.shape[-1]).expand_as(ids)
    is_open = torch.isin(ids, markers.opens)
    last_open = torch.cummax(torch.where(is_open, idx, -1), dim=-1).values
    last_close = torch.cummax(torch.where(torch.isin(ids, markers.closes), idx, -1), dim=-1).values
    return (last_open > last_close) & ~is_open


def token_weights(ids: torch.Tensor, doc: torch.Tensor, prompt_weight: float, value_weight: float = 1.0,
                  markers: ValueMarkers | None = None) -> torch.Tensor:
    """-> (B, T+1) loss weight of each token as a label.

        one row: <bos><plan>go home<sep>[{"  skill  ":"  wait ...<eos> | <bos><text>To be
        weights:  .3    .3   .3  .3   .3   1    1     1    vw  ... vw  |  1      1    1  1"""
    prompt, answer = prompt_and_answer(ids, doc)
    w = torch.where(prompt, prompt_weight, 1.0)
    if markers is not None and value_weight != 1.0:
        w = torch.where(answer & (value_mask(ids, markers) | (ids == EOS_ID)), value_weight, w)
    return w
