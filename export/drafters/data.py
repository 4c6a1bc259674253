"""Distillation data for drafters of the zoo target: the zoo's three domains (robot planner, action tokens,
Shakespeare), generated afresh from their generators with a seed of their own and tokenized with the TARGET's
tokenizer. Only the token ids matter: the labels are the target's own predictions (see `trainer.py`).

Cached as <work>/data.npz (object arrays of int16 rows), so a resumed or repeated run does not regenerate."""
from __future__ import annotations

import os
import time
from typing import Dict, List

import numpy as np

DOMAINS = ("planner", "action", "text")


def build_token_data(tokenizer_json: str, work: str, seed: int, n_planner: int, n_action: int, n_text: int,
                     log=print) -> Dict[str, List[np.ndarray]]:
    """{'planner_train': [ids...], 'action_train': [...], 'text_train': [...]}, each example one int16 array."""
    path = os.path.join(work, "data.npz")
    key = np.asarray([seed, n_planner, n_action, n_text])
    if os.path.exists(path):
        z = np.load(path, allow_pickle=True)  # our own cache, written below (object arrays of int16)
        if "key" in z.files and np.array_equal(z["key"], key):
            return {k: list(z[k]) for k in z.files if k != "key"}
    from tokenizers import Tokenizer

    from export.zoo.action_data import action_text, generate_action_examples
    from export.zoo.planner_data import generate_planner_examples
    from export.zoo.text_data import load_works, split_text
    from export.zoo.train import TEXT_CACHE
    from runtime.text.prompts import BOS, EOS, TEXT

    t0 = time.time()
    texts = {"planner_train": [e.text for e in generate_planner_examples(seed * 1000 + 11, n_planner)],
             "action_train": [action_text(e) for e in generate_action_examples(seed * 1000 + 13, n_action)]}
    try:
        works = load_works(TEXT_CACHE, quiet=False, allow_fallback=False)
        train_text, _ = split_text(works, seed, n_text, 4)  # held-out works stay out, as in the zoo build
        texts["text_train"] = [f"{BOS}{TEXT}{x}{EOS}" for x in train_text]
    except RuntimeError as exc:  # no network and no cache: train on the two robot domains only, and say so
        log(f"no Shakespeare texts ({exc}); training on planner and action data only")
    tok = Tokenizer.from_file(tokenizer_json)
    data = {k: [np.asarray(e.ids, dtype=np.int16) for e in tok.encode_batch(v)] for k, v in texts.items()}
    os.makedirs(work, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"  # torchrun: every process may build it; each renames a whole file
    np.savez(tmp, key=key, **{k: np.array(v, dtype=object) for k, v in data.items()})
    os.replace(tmp, path)
    log("distillation data: " + ", ".join(f"{k} {len(v)}" for k, v in data.items())
        + f" examples in {time.time() - t0:.0f} s")
    return data
