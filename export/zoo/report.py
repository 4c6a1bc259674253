"""`edgespec zoo report`: held-out losses and output quality of a built zoo.

The held-out sets are regenerated from the seed and sizes recorded in MANIFEST.yaml (the text domain needs the
cached Shakespeare texts; it is skipped with a note when they are absent). Greedy decoding uses
`transformers.LlamaForCausalLM` on the shipped fp16 checkpoint (the MTP keys are ignored there), which also
checks that the target is a loadable HF Llama.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List

import numpy as np
import torch

from export.zoo.action_data import action_text, split_actions
from export.zoo.loss_weights import ValueMarkers
from export.zoo.model import load_hf
from export.zoo.planner_data import split_planner
from export.zoo.train import DOMAINS, TEXT_CACHE, heldout_metrics, log, read_manifest
from runtime.text.actions import ActionTokenizer
from runtime.errors import RequestError
from runtime.text.prompts import ACTION_CHUNK, ACTION_DIMS, BOS, EOS, TEXT, parse_plan, plan_objects


def _heldout_data(zoo: str, manifest: dict, tok) -> tuple:
    bc = manifest["build_config"]
    seed, n_he = bc["seed"], bc["n_heldout"]
    _, plan_he = split_planner(seed, bc["n_planner"], n_he)
    _, act_he = split_actions(seed, bc["n_action"], n_he)
    texts = {"planner_heldout": [e.text for e in plan_he], "action_heldout": [action_text(e) for e in act_he]}
    try:
        from export.zoo.text_data import load_works, split_text

        works = load_works(TEXT_CACHE, quiet=True, allow_fallback=False)
        _, text_he = split_text(works, seed, bc["n_text"], max(n_he // 3, 4))
        texts["text_heldout"] = [f"{BOS}{TEXT}{x}{EOS}" for x in text_he]
    except Exception as exc:  # the shipped zoo needs no texts; only this number does
        log(f"text domain skipped: {exc}")
    data = {k: [np.asarray(e.ids) for e in tok.encode_batch(v)] for k, v in texts.items()}
    return data, plan_he, act_he


@torch.no_grad()
def greedy(model, tok, prompts: List[str], max_new: int, batch: int = 32) -> List[List[int]]:
    """Greedy continuations (token ids, up to and excluding EOS) of left-padded prompt batches."""
    eos = tok.token_to_id(EOS)
    outs = []
    for i in range(0, len(prompts), batch):
        enc = [e.ids for e in tok.encode_batch(prompts[i:i + batch])]
        L = max(map(len, enc))
        ids = torch.zeros(len(enc), L, dtype=torch.long)
        att = torch.zeros(len(enc), L, dtype=torch.long)
        for j, e in enumerate(enc):
            ids[j, L - len(e):] = torch.tensor(e)
            att[j, L - len(e):] = 1
        gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        for row in gen[:, L:].tolist():
            outs.append(row[:row.index(eos)] if eos in row else row)
    return outs


def planner_quality(model, tok, examples) -> Dict[str, float]:
    valid = match = exact = 0
    for ex, out in zip(examples, greedy(model, tok, [e.prompt for e in examples], max_new=220)):
        text = tok.decode(out, skip_special_tokens=True)
        try:
            steps = parse_plan(text)
        except RequestError:
            continue
        valid += 1
        match += plan_objects(steps) == plan_objects(list(ex.plan))
        exact += steps == list(ex.plan)
    n = len(examples)
    return {"n": n, "valid_json": round(valid / n, 4), "valid_and_objects_match": round(match / n, 4),
            "exact_plan": round(exact / n, 4)}


def action_quality(model, tok, examples) -> Dict[str, float]:
    """`in_range`: the greedy answer is exactly one chunk of ACTION_CHUNK x ACTION_DIMS action tokens, then EOS, and
    decodes to in-range actions. `first_chunk_in_range`: the first ACTION_CHUNK x ACTION_DIMS tokens are action
    tokens decoding to in-range actions, whether or not the model then stops (what `Session.action_tokens` serves:
    it reads exactly one chunk, under the action-token mask)."""
    at = ActionTokenizer.from_tokenizer(tok)
    in_range = first_ok = 0
    errs = []
    want = ACTION_CHUNK * ACTION_DIMS
    low, high = np.asarray(at.low) - 1e-6, np.asarray(at.high) + 1e-6
    for ex, out in zip(examples, greedy(model, tok, [e.prompt for e in examples], max_new=want + 2)):
        chunk = out[:want]
        if len(chunk) != want or not all(at.is_action_token(t) for t in chunk):
            continue
        a = at.decode(chunk)  # (ACTION_CHUNK, 7) at bin centres
        if not (np.all(a >= low) and np.all(a <= high)):
            continue
        first_ok += 1
        if len(out) == want:  # stopped (EOS) right after the chunk
            in_range += 1
            errs.append(np.abs(a - np.asarray(ex.actions)).mean(0))
    n = len(examples)
    res = {"n": n, "in_range": round(in_range / n, 4), "first_chunk_in_range": round(first_ok / n, 4)}
    if errs:
        e = np.mean(errs, 0)
        res["mean_abs_error_xyz_m"] = round(float(e[:3].mean()), 4)
        res["mean_abs_error_rpy_rad"] = round(float(e[3:6].mean()), 4)
        res["mean_abs_error_gripper"] = round(float(e[6]), 4)
    return res


def quality_report(zoo: str, n: int = 200, write: bool = True) -> dict:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    import yaml

    t0 = time.time()
    torch.set_num_threads(1)  # small-batch decoding is op-bound; one thread also behaves on a shared CPU
    manifest = read_manifest(zoo)
    tok = Tokenizer.from_file(os.path.join(zoo, "target", "tokenizer.json"))
    data, plan_he, act_he = _heldout_data(zoo, manifest, tok)
    target, draft = load_hf(os.path.join(zoo, "target")), load_hf(os.path.join(zoo, "draft"))
    losses = heldout_metrics(target, draft, data, markers=ValueMarkers.from_tokenizer(tok))
    hf_logging.set_verbosity_error()  # the MTP keys are "unexpected" to plain Llama, by design
    hf = LlamaForCausalLM.from_pretrained(os.path.join(zoo, "target"), torch_dtype=torch.float32).eval()
    report = {
        "heldout": losses,
        "planner": planner_quality(hf, tok, plan_he[:n]),
        "action": action_quality(hf, tok, act_he[:n]),
        "seconds": round(time.time() - t0, 1),
    }
    lines = ["held-out (per token; agreement = top-1 equal to the target's):"]
    for d in DOMAINS:
        if d in losses:
            m = losses[d]
            lines.append(f"  {d:8s} loss {m['loss']:.3f}  mtp loss {m.get('mtp_loss', float('nan')):.3f}  "
                         f"mtp agree {m.get('mtp_agree', float('nan')):.3f}  draft loss {m.get('draft_loss', float('nan')):.3f}  "
                         f"draft agree {m.get('draft_agree', float('nan')):.3f}"
                         + (f"  plan-argument acc {m['args_acc']:.3f}" if "args_acc" in m else ""))
    p, a = report["planner"], report["action"]
    lines.append(f"planner greedy ({p['n']}): valid JSON {p['valid_json']:.1%}, valid + objects match "
                 f"{p['valid_and_objects_match']:.1%}, exact plan {p['exact_plan']:.1%}")
    lines.append(f"action greedy ({a['n']}): one in-range chunk then EOS {a['in_range']:.1%}, first chunk in range "
                 f"{a['first_chunk_in_range']:.1%}"
                 + (f", mean |err| xyz {a['mean_abs_error_xyz_m']:.4f} m" if "mean_abs_error_xyz_m" in a else ""))
    print("\n".join(lines), flush=True)
    if write:
        manifest["quality"] = report
        with open(os.path.join(zoo, "MANIFEST.yaml"), "w") as f:
            yaml.safe_dump(manifest, f, sort_keys=False, width=110)
    return report
