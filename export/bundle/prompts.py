"""The prompt format `edgespec bundle` records for a model: what its HF directory says (chat template, special
tokens, EOS list), edgespec's default task templates, and the user's own templates on top.

Defaults, by what the model is:
  the zoo (its tokenizer has <|plan|>, <|sep|>, ...) -> runtime.text.prompts.ZOO_PROMPTS, today's zoo prompts
  a model with a chat template (Qwen3, Llama-3 instruct, ...) -> CHAT_PLANNER / CHAT_ACTION through that
    template, text = BOS + text
  neither (a base model) -> text only; --planner-template / --prompts give it a planner
User files (YAML), applied in this order, each replacing what it names:
  --prompts FILE            a `prompts:` section: planner / action / text templates, eos_tokens (added to the
                            model's), special_tokens, chat_template_kwargs, chat_template (inline Jinja)
  --chat-template FILE      the chat template (Jinja), instead of the directory's
  --planner-template FILE   one template: {raw: ...} or {system: ..., user: ...}
  --action-template FILE    likewise"""
from __future__ import annotations

import copy

import os
from typing import Any, Dict, List, Optional, Tuple

import yaml

from export.bundle.hf_reader import read_hf_prompts
from runtime.errors import BundleError
from runtime.text.prompts import CHAT_ACTION, CHAT_PLANNER, ZOO_PROMPTS, format_observation, zoo_tokens_in
from runtime.text.templates import PromptFormat, task_template

# Request values a template is tried with at bundle time, so that a template that cannot render fails there.
PROBE = {"planner": {"instruction": "bring me the red cup", "context": "failed pick: not found"},
         "action": {"instruction": "pick up the red cup", "observation": format_observation([0.0] * 8)},
         "text": {"text": "To be, or not to be"}}


def _yaml(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise BundleError(f"{what} {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise BundleError(f"{what} {path}: not valid YAML ({exc})") from exc


def _text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{what} {path}: cannot read it ({exc})") from exc


def defaults(target_dir: str, tokenizer) -> Tuple[Dict[str, Any], List[str]]:
    """The `prompts` section (chat template inline) a model gets without user files, and notes saying why."""
    hf = read_hf_prompts(target_dir, tokenizer)
    if zoo_tokens_in(tokenizer):
        d = ZOO_PROMPTS.to_dict()
        d["eos_tokens"] = list(dict.fromkeys(list(ZOO_PROMPTS.eos_tokens) + hf.eos_tokens))
        return d, ["the zoo's task templates (the tokenizer has its task tokens)"]
    d: Dict[str, Any] = {"special_tokens": hf.special_tokens, "eos_tokens": hf.eos_tokens}
    bos = "{{ bos_token }}" if "bos_token" in hf.special_tokens else ""
    d["text"] = {"raw": bos + "{{ text }}"}
    if hf.chat_template:
        d["chat_template"] = hf.chat_template
        d["planner"], d["action"] = CHAT_PLANNER.to_dict(), CHAT_ACTION.to_dict()
        return d, [f"chat template from {hf.chat_template_from}; edgespec's chat planner and action templates"]
    return d, ["no chat template and no task tokens: text only. For plans give --planner-template FILE "
               "(or --prompts FILE, or --chat-template FILE for the default chat planner)"]


def bundle_prompts(target_dir: Optional[str], tokenizer, prompts_file: Optional[str] = None,
                   chat_template_file: Optional[str] = None, planner_file: Optional[str] = None,
                   action_file: Optional[str] = None,
                   base: Optional[Dict[str, Any]] = None) -> Tuple[PromptFormat, List[str]]:
    """The checked PromptFormat for the bundle of `target_dir` (see the module doc) and notes for the user.
    `base`: a `prompts` section (chat template as its source) to lay the files over instead of the model's
    own, e.g. the bundle's current one (`edgespec bundle set-prompts`)."""
    d, notes = (copy.deepcopy(dict(base)), []) if base is not None else defaults(target_dir, tokenizer)
    if prompts_file:
        section = _yaml(prompts_file, "--prompts")
        if isinstance(section, dict) and set(section) == {"prompts"}:
            section = section["prompts"]
        PromptFormat.from_dict(section, f"--prompts {prompts_file}: prompts", partial=True)  # errors name the file
        for key, value in section.items():
            if key == "eos_tokens":
                d[key] = list(dict.fromkeys(list(d.get(key, [])) + value))
            elif key in ("special_tokens", "chat_template_kwargs"):
                d[key] = {**d.get(key, {}), **value}
            else:
                d[key] = value
        notes.append(f"{', '.join(section)} from {prompts_file}")
    if chat_template_file:
        d["chat_template"] = _text(chat_template_file, "--chat-template")
        if "planner" not in d:
            d["planner"], d["action"] = CHAT_PLANNER.to_dict(), CHAT_ACTION.to_dict()
        notes.append(f"chat template from {chat_template_file}")
    for task, path in (("planner", planner_file), ("action", action_file)):
        if path:
            d[task] = task_template(_yaml(path, f"--{task}-template"), task, f"--{task}-template {path}",
                                    set(d.get("special_tokens", {}))).to_dict()
            notes.append(f"{task} template from {path}")
    fmt = PromptFormat.from_dict(d, "the bundle's prompts")
    for task in fmt.tasks:
        try:
            fmt.render(task, **PROBE[task])
        except BundleError as exc:
            raise BundleError(f"the {task} template cannot be rendered with this model's chat template: {exc}") from None
    for token in fmt.eos_tokens:
        if tokenizer.token_to_id(token) is None:
            raise BundleError(f"eos_tokens: {token!r} is not a token of the model's tokenizer.json; name a token "
                              "it has (e.g. the one its chat template ends a turn with)")
    return fmt, notes

