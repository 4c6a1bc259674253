"""`train-drafter --data FILE`: the user's prompts or chats as distillation data, answered by the frozen target.

FILE is JSON Lines, one example a line (blank lines skipped):
    {"prompt": "bring me the red cup"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}, ...]}
Each is rendered as the bundle renders requests (export/bundle/prompts.py -> runtime.text.templates.PromptFormat):
through the target's own chat template with the generation prompt (a prompt is one user turn; trailing assistant
turns are dropped: the target writes the answer), or, for a base model without one, as its text template
(BOS + text). The target then writes `samples` continuations of each: the first greedy, the others sampled at
temperature 1 (the self-distillation of the EAGLE and DFlash recipes), up to `max_new` tokens or an EOS token,
so every row is text the target itself would produce. With keep_answers a chat ending in an assistant turn
is kept whole instead (answers the same target wrote with a faster engine; the labels are still the target's). Every 20th prompt (with fewer than 20, the last) is held
out for evaluation.

A line that is not such an object is refused with a ConfigError naming the file, the line and the field."""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Dict, List, Sequence

import numpy as np
import torch

from runtime.errors import ConfigError

ROLES = ("system", "user", "assistant")


def read_data_file(path: str, keep_answers: bool = False) -> List[List[Dict[str, str]]]:
    """FILE -> one message list per example (a prompt becomes [{"role": "user", "content": prompt}]); trailing
    assistant turns are dropped (the target answers) unless keep_answers."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data {path}: no such file; give a JSONL file of {{\"prompt\": ...}} or "
                          "{\"messages\": [...]} lines")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(_example(line, f"--data {path} line {n}", keep_answers))
    if not out:
        raise ConfigError(f"--data {path}: no examples (every line is blank)")
    return out


def _example(line: str, where: str, keep_answers: bool = False) -> List[Dict[str, str]]:
    try:
        d = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object with \"prompt\" or \"messages\", got {type(d).__name__}")
    keys = [k for k in ("prompt", "messages") if k in d]
    if len(keys) != 1:
        raise ConfigError(f"{where}: expected exactly one of the fields \"prompt\" and \"messages\", got "
                          f"{sorted(d) or 'none'}")
    if keys == ["prompt"]:
        if not isinstance(d["prompt"], str) or not d["prompt"].strip():
            raise ConfigError(f"{where}: field \"prompt\": expected a non-empty string, got {d['prompt']!r}")
        return [{"role": "user", "content": d["prompt"]}]
    msgs = d["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError(f"{where}: field \"messages\": expected a non-empty list of {{role, content}} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: field \"messages[{i}]\": expected an object with role and content")
        if m.get("role") not in ROLES:
            raise ConfigError(f"{where}: field \"messages[{i}].role\": got {m.get('role')!r}, expected one of "
                              f"{list(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: field \"messages[{i}].content\": expected a string, got "
                              f"{m.get('content')!r}")
    while msgs and msgs[-1]["role"] == "assistant" and not keep_answers:  # the target writes the answer itself
        msgs = msgs[:-1]
    if not any(m["role"] == "user" for m in msgs):
        raise ConfigError(f"{where}: field \"messages\": no user turn to answer")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def render(fmt, messages: List[Dict[str, str]]) -> str:
    """The prompt text of one example, as the bundle's prompt format renders a request for this model (a chat
    ending in an assistant turn: the whole conversation, no generation prompt)."""
    if fmt.chat_template:
        return fmt.render_chat(messages, add_generation_prompt=messages[-1]["role"] != "assistant")
    return fmt.render("text", text="\n\n".join(m["content"] for m in messages))


@torch.no_grad()
def continue_prompt(target, prompt: Sequence[int], max_new: int, eos: Sequence[int],
                    generator: torch.Generator = None) -> List[int]:
    """The target's continuation of `prompt` (greedy, or sampled at T = 1 with `generator`), with a KV cache;
    ends after an EOS token (kept) or max_new tokens."""
    device = target.embed_tokens.weight.device
    caches = [[] for _ in target.layers]
    logits = target.step(torch.tensor([list(prompt)], device=device), 0, caches)
    out: List[int] = []
    while len(out) < max_new:
        if generator is None:
            tok = int(logits.argmax())
        else:
            tok = int(torch.multinomial(torch.softmax(logits.cpu(), -1), 1, generator=generator))
        out.append(tok)
        if tok in eos:
            break
        logits = target.step(torch.tensor([[tok]], device=device), len(prompt) + len(out) - 1, caches)
    return out


@torch.no_grad()
def continue_prompts(target, prompts: Sequence[Sequence[int]], max_new: Sequence[int], eos: Sequence[int],
                     seed: int = None, batch: int = 32) -> List[List[int]]:
    """`continue_prompt` for many prompts, `batch` at a time (greedy, or sampled at T = 1 from torch.Generator(seed)
    when seed is given); prompt i gets up to max_new[i] tokens. Prompts of a batch are left-padded to one length:
    a pad row attends only to itself (so it stays finite) and no real row attends to a pad; each row's positions
    start at 0 where its own tokens start, so its continuation is the one it gets alone (up to float rounding of
    the batched matmuls). Prompts are batched by length (sorted), the answers returned in the prompts' order."""
    device = target.embed_tokens.weight.device
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: List[List[int]] = [[] for _ in prompts]
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        L = max(len(prompts[i]) for i in idx)
        pad = torch.tensor([L - len(prompts[i]) for i in idx], device=device)
        ids = torch.tensor([[0] * (L - len(prompts[i])) + list(prompts[i]) for i in idx], device=device)
        col = torch.arange(L, device=device)
        real = col[None] >= pad[:, None]  # (B, L): key j is a real token of row b
        mask = (col[None, :, None] >= col[None, None, :]) & real[:, None, :]  # causal, real keys
        mask = (mask | torch.eye(L, dtype=torch.bool, device=device)[None])[:, None]  # a pad row sees itself
        pos = (col[None] - pad[:, None]).clamp(min=0)
        caches = [[] for _ in target.layers]
        logits = _batch_step(target, ids, pos, mask, caches)
        room = torch.tensor([max_new[i] for i in idx], device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        toks = []
        for t in range(int(room.max())):
            if gen is None:
                tok = logits.argmax(-1)
            else:
                tok = torch.multinomial(torch.softmax(logits.float().cpu(), -1), 1, generator=gen)[:, 0].to(device)
            toks.append(tok)
            done |= torch.isin(tok, torch.tensor(sorted(eos), dtype=tok.dtype, device=device)) | (t + 1 >= room)
            if bool(done.all()):
                break
            real = torch.cat([real, torch.ones(len(idx), 1, dtype=torch.bool, device=device)], 1)
            logits = _batch_step(target, tok[:, None], pos[:, -1:] + 1 + t, real[:, None, None, :], caches)
        if toks:
            cols = torch.stack(toks, 1).tolist()
            for r, i in enumerate(idx):
                row = cols[r][:max_new[i]]
                ends = [n for n, x in enumerate(row) if x in eos]
                out[i] = row[:ends[0] + 1] if ends else row
    return out


def _batch_step(target, ids, positions, mask, caches):
    """One forward of (B, T) new tokens at `positions` with KV caches and an explicit mask -> last logits (B, V)."""
    cos, sin = target.rope(positions)
    x = target.embed_tokens(ids)
    for layer, cache in zip(target.layers, caches):
        x = layer(x, cos.to(x.dtype), sin.to(x.dtype), mask, cache)
    return target.head(target.norm(x[:, -1])).float()


def cached_rows(path: str):
    """The rows a build_*_data wrote to `path` ({name: [int32 arrays]}), or None if it is not there."""
    if not os.path.exists(path):
        return None
    z = np.load(path, allow_pickle=True)  # our own cache, written by write_rows (object arrays of int32)
    return {k: list(z[k]) for k in z.files}


def write_rows(path: str, data: Dict[str, List[np.ndarray]]) -> None:
    """Atomically (torchrun: every process may build it; each renames a whole file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **{k: np.array(v + [None], dtype=object)[:-1] for k, v in data.items()})
    os.replace(tmp, path)


def answering(target_dir: str):
    """(tokenizer, prompt format, EOS ids) with which the target's prompts are rendered and answered, as the
    bundle renders requests."""
    from export.bundle.prompts import bundle_prompts
    from export.drafters.target import eos_ids
    from runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(os.path.join(target_dir, "tokenizer.json"))
    return tok, bundle_prompts(target_dir, tok)[0], set(eos_ids(target_dir))


def build_user_data(target_dir: str, target, data_file: str, work: str, seed: int, samples: int, max_new: int,
                    log=print, keep_answers: bool = False) -> Dict[str, List[np.ndarray]]:
    """{'data_train': [...], 'data_heldout': [...]}: prompt + target continuation rows (int32), cached in
    work/ under a hash of the target, the file and the settings. keep_answers: a chat that ends in an answer is
    one row as given (no generation); the others are still answered by the target."""
    examples = read_data_file(data_file, keep_answers)  # refuses a malformed line before any work
    with open(data_file, "rb") as f:
        key = hashlib.sha256(f.read() + f"{target.fingerprint}:{seed}:{samples}:{max_new}:{keep_answers}".encode()).hexdigest()[:16]
    path = os.path.join(work, f"user-data-{key}.npz")
    cached = cached_rows(path)
    if cached is not None:
        return cached
    tok, fmt, eos = answering(target_dir)
    t0 = time.time()
    data: Dict[str, List[np.ndarray]] = {"data_train": [], "data_heldout": []}
    rows = []  # (split, prompt ids, answered by the target?)
    for n, messages in enumerate(examples):
        prompt = tok.encode(render(fmt, messages))
        if len(prompt) >= target.cfg.max_position_embeddings:
            raise ConfigError(f"--data {data_file}: example {n + 1} renders to {len(prompt)} tokens, more than the "
                              f"target's {target.cfg.max_position_embeddings} positions; shorten it")
        held = n % 20 == 19 or (len(examples) < 20 and n == len(examples) - 1)  # fewer: the last prompt
        rows.append(("data_heldout" if held and len(examples) > 1 else "data_train", prompt,
                     messages[-1]["role"] != "assistant"))  # --keep-answers: a chat's answer as given
    asked = [p for _, p, ask in rows if ask]
    room = [min(max_new, target.cfg.max_position_embeddings - len(p)) for p in asked]
    passes = []
    for s in range(samples if asked else 0):  # batched: the first pass greedy, the others sampled
        passes.append(iter(continue_prompts(target, asked, room, eos, None if s == 0 else seed * 1_000_003 + s)))
        log(f"--data: {len(asked)} prompts answered x {s + 1} ({time.time() - t0:.0f} s)")
    for split, prompt, ask in rows:
        data[split].extend([np.asarray(prompt + next(a), np.int32) for a in passes] if ask
                           else [np.asarray(prompt, np.int32)])
    if not data["data_heldout"]:
        data.pop("data_heldout")
    write_rows(path, data)
    log(f"--data {data_file}: {len(examples)} prompts, {samples} continuation(s) each by the target (first greedy, "
        f"then sampled at T = 1), {sum(len(x) for v in data.values() for x in v)} tokens in {time.time() - t0:.0f} s")
    return data
