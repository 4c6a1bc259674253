"""Distillation data for drafters: token rows the frozen target is run over. Only the token ids matter: the labels
are the target's own predictions (see `trainer.py`).

Two sources:
  the zoo's three domains (default): robot planner, action tokens, Shakespeare, generated afresh from their
      generators with a seed of their own and tokenized with the TARGET's tokenizer (export/drafters/data.py);
  a --data FILE (export/drafters/user_data.py): the user's prompts or chats, rendered with the target's own
      chat template, answered by the target itself.

Cached as <work>/data-<tokenizer hash>.npz (object arrays of int32 rows), so a resumed or repeated run does not regenerate."""
from __future__ import annotations

import hashlib
import os
import time
from typing import Dict, List

import numpy as np

DOMAINS = ("planner", "action", "text")


def build_token_data(tokenizer_json: str, work: str, seed: int, n_planner: int, n_action: int, n_text: int,
                     log=print) -> Dict[str, List[np.ndarray]]:
    """{'planner_train': [ids...], 'action_train': [...], 'text_train': [...]}, each example one int32 array
    (a count of 0 leaves its domain out)."""
    with open(tokenizer_json, "rb") as f:  # one file per tokenizer: a shared cache serves several targets
        path = os.path.join(work, f"data-{hashlib.sha256(f.read()).hexdigest()[:12]}.npz")
    key = np.asarray([seed, n_planner, n_action, n_text, 32])  # 32: int32 rows (a 151k vocabulary fits)
    if os.path.exists(path):
        z = np.load(path, allow_pickle=True)  # our own cache, written below (object arrays of int32)
        if "key" in z.files and np.array_equal(z["key"], key):
            return {k: list(z[k]) for k in z.files if k != "key"}
    from tokenizers import Tokenizer

    from export.zoo.action_data import action_text, generate_action_examples
    from export.zoo.planner_data import generate_planner_examples
    from export.zoo.text_data import load_works, split_text
    from export.zoo.train import TEXT_CACHE
    from runtime.text.prompts import BOS, EOS, TEXT

    t0 = time.time()
    texts = {}
    if n_planner:
        texts["planner_train"] = [e.text for e in generate_planner_examples(seed * 1000 + 11, n_planner)]
    if n_action:
        texts["action_train"] = [action_text(e) for e in generate_action_examples(seed * 1000 + 13, n_action)]
    try:
        if n_text:
            works = load_works(TEXT_CACHE, quiet=False, allow_fallback=False)
            train_text, _ = split_text(works, seed, n_text, 4)  # held-out works stay out, as in the zoo build
            texts["text_train"] = [f"{BOS}{TEXT}{x}{EOS}" for x in train_text]
    except RuntimeError as exc:  # no network and no cache: train on the two robot domains only, and say so
        log(f"no Shakespeare texts ({exc}); training on planner and action data only")
    tok = Tokenizer.from_file(tokenizer_json)
    data = {k: [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(v)] for k, v in texts.items()}
    os.makedirs(work, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # torchrun: every process may build it; each renames a whole file
    np.savez(tmp, key=key, **{k: np.array(v, dtype=object) for k, v in data.items()})
    os.replace(tmp, path)
    log("distillation data: " + ", ".join(f"{k} {len(v)}" for k, v in data.items())
        + f" examples in {time.time() - t0:.0f} s")
    return data


def split_heldout(data: Dict[str, List[np.ndarray]], every: int = 20) -> Dict[str, List[np.ndarray]]:
    """Every `every`-th example of each <pool>_train moved to <pool>_heldout (the held-out evaluation's rows;
    a pool of fewer than `every` examples gives its last one)."""
    out: Dict[str, List[np.ndarray]] = {}
    for k, v in data.items():
        if not k.endswith("_train") or len(v) < 2:
            out[k] = v
            continue
        held = set(range(every - 1, len(v), every)) or {len(v) - 1}
        out[k] = [x for i, x in enumerate(v) if i not in held]
        out[k[:-len("_train")] + "_heldout"] = [v[i] for i in sorted(held)]
    return out
