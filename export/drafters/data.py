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


def zoo_prompts(fmt, seed: int, n_planner: int, n_action: int, n_text: int, log=print) -> Dict[str, List[str]]:
    """{'planner': [...], 'action': [...], 'text': [...]}: the zoo domains' requests (the generators' instructions,
    contexts and observations; a passage's first 3-12 words) rendered in the target's prompt format `fmt`, as the
    bundle renders them. A domain `fmt` has no template for is left out, and said."""
    import random

    from export.zoo.action_data import generate_action_examples
    from export.zoo.planner_data import generate_planner_examples
    from export.zoo.text_data import load_works, split_text
    from export.zoo.train import TEXT_CACHE
    from runtime.text.prompts import format_observation

    out: Dict[str, List[str]] = {}
    if n_planner and fmt.has("planner"):
        out["planner"] = [fmt.render("planner", instruction=e.instruction, context=e.context)
                          for e in generate_planner_examples(seed * 1000 + 11, n_planner)]
    if n_action and fmt.has("action"):
        out["action"] = [fmt.render("action", instruction=e.instruction, observation=format_observation(e.observation))
                         for e in generate_action_examples(seed * 1000 + 13, n_action)]
    if n_text and fmt.has("text"):
        try:
            passages, _ = split_text(load_works(TEXT_CACHE, quiet=False, allow_fallback=False), seed, n_text, 4)
            rng = random.Random(seed * 1000 + 17)
            out["text"] = [fmt.render("text", text=" ".join(p.split()[:rng.randint(3, 12)])) for p in passages]
        except RuntimeError as exc:
            log(f"no Shakespeare texts ({exc}); answering planner and action prompts only")
    for d in DOMAINS:
        if d not in out and {"planner": n_planner, "action": n_action, "text": n_text}[d]:
            log(f"the target's prompt format has no {d} template: no {d} prompts")
    return out


def build_answered_data(target_dir: str, target, work: str, seed: int, n_planner: int, n_action: int, n_text: int,
                        samples: int, max_new: int, log=print) -> Dict[str, List[np.ndarray]]:
    """{'<domain>_train': [...], '<domain>_heldout': [...]} like `split_heldout(build_token_data(...))`, but each row is a zoo prompt (`zoo_prompts`) and the
    TARGET's own answer: `samples` continuations each, the first greedy, the rest sampled at T = 1, up to max_new
    tokens or an EOS token (the self-distillation of the EAGLE-3 and DFlash recipes, as `--data` does for a user's
    prompts). The drafter then learns the text it will be asked to guess. Cached in work/ under a hash of the
    target and the settings. Every 20th prompt is held out with all its answers (none of them trains)."""
    from export.drafters.user_data import answering, cached_rows, continue_prompts, write_rows

    key = f"{target.fingerprint}:{seed}:{n_planner}:{n_action}:{n_text}:{samples}:{max_new}"
    path = os.path.join(work, f"answered-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")
    cached = cached_rows(path)
    if cached is not None:
        return cached
    tok, fmt, eos = answering(target_dir)
    limit = target.cfg.max_position_embeddings
    t0 = time.time()
    data: Dict[str, List[np.ndarray]] = {}
    for d, texts in zoo_prompts(fmt, seed, n_planner, n_action, n_text, log).items():
        prompts = [p for p in (tok.encode(t) for t in texts) if len(p) < limit]
        room = [min(max_new, limit - len(p)) for p in prompts]
        passes = []
        for s in range(samples):
            passes.append(continue_prompts(target, prompts, room, eos, None if s == 0 else seed * 1_000_003 + s,
                                           batch=128))
            log(f"zoo {d} prompts answered by the target: {len(prompts)} x {s + 1} "
                f"({sum(len(a) for a in passes[-1])} tokens this pass, {time.time() - t0:.0f} s)")
        for n, p in enumerate(prompts):  # each prompt's answers in a row; every 20th prompt held out with all of them
            split = f"{d}_{'heldout' if n % 20 == 19 else 'train'}"
            data.setdefault(split, []).extend(np.asarray(p + a[n], np.int32) for a in passes)
    write_rows(path, data)
    return data
