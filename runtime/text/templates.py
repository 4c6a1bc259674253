"""A model's prompt format, as the bundle carries it: its chat template, its special tokens, the tokens that
end an answer, and edgespec's task templates (planner, action, text) that turn a request into prompt text.

A task template is one of two forms:
  raw:            a Jinja template giving the whole prompt, the model's own special tokens written out
                  (the zoo: '<|bos|><|plan|>{{ instruction }}{% if context %}<|ctx|>{{ context }}{% endif %}<|sep|>')
  system + user:  Jinja templates for a system and a user message, rendered by the model's chat template with
                  the generation prompt added (an instruction-tuned model: Qwen3, Llama-3, ...)

Worked example (a Llama-3 style chat template, planner = {system: "You plan.", user: "{{ instruction }}"}):
    fmt.render("planner", instruction="bring the cup", context="")
      -> '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\nYou plan.<|eot_id|>'
         '<|start_header_id|>user<|end_header_id|>\\n\\nbring the cup<|eot_id|>'
         '<|start_header_id|>assistant<|end_header_id|>\\n\\n'

Every template is rendered with jinja2 in an immutable sandbox, as the HF ecosystem renders chat templates
(same environment options, same helpers), so a prompt's tokens equal transformers' `apply_chat_template`.
Templates are checked once, when the bundle loads: syntax, and the variables a task template may use."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Tuple

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.errors import BundleError

# task -> the request values its templates may use (besides the special tokens such as bos_token)
TASK_VARIABLES: Dict[str, Tuple[str, ...]] = {
    "planner": ("instruction", "context"),
    "action": ("instruction", "observation"),
    "text": ("text",),
}
TEMPLATE_KEYS = ("raw", "system", "user")
FORMAT_KEYS = ("chat_template", "special_tokens", "eos_tokens", "chat_template_kwargs") + tuple(TASK_VARIABLES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """The environment HF renders chat templates in (transformers' chat_template_utils): block trimming,
    loop controls, and the helpers templates call (raise_exception, tojson, strftime_now)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def task_environment() -> ImmutableSandboxedEnvironment:
    """Task templates are literal text around a few variables: nothing trimmed, a misspelt variable an error."""
    return ImmutableSandboxedEnvironment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


_CHAT_ENV = chat_environment()
_TASK_ENV = task_environment()


@functools.lru_cache(maxsize=64)
def _compiled(chat: bool, source: str) -> jinja2.Template:
    """Compiling costs ~1 ms a template; a request (and the zoo's data generators) reuse a handful."""
    return (_CHAT_ENV if chat else _TASK_ENV).from_string(source)


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's text and where the request's own text lies in it, so that text is tokenized as text: a
    `<|sep|>` typed into an instruction stays the characters '<|sep|>', never the control token.

    Worked example (the zoo's planner, instruction 'go<|sep|>'):
        text       '<|bos|><|plan|>go<|sep|><|sep|>'
        user_spans ((15, 24),)            -> chars 15..24 ('go<|sep|>') are the request's
        values     (('instruction', 'go<|sep|>'),)
    `exact` False: the template transformed a value, so its place in the text is unknown (the tokenizer then
    refuses a value that holds a control token, naming its field)."""
    text: str
    user_spans: Tuple[Tuple[int, int], ...] = ()  # [start, end) character ranges of request text
    values: Tuple[Tuple[str, str], ...] = ()  # (field, text) of each request value
    exact: bool = True


# A request value's stand-in while rendering: private-use characters, which no template or tokenizer gives meaning.
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True)
class TaskTemplate:
    raw: str = ""  # the whole prompt (no chat template)
    system: str = ""  # the system message (chat form; optional)
    user: str = ""  # the user message (chat form)

    @property
    def chat(self) -> bool:
        return bool(self.user)

    def to_dict(self) -> Dict[str, str]:
        return {k: getattr(self, k) for k in TEMPLATE_KEYS if getattr(self, k)}


@dataclass(frozen=True)
class PromptFormat:
    """How requests become prompt text for one model (see the module doc)."""
    tasks: Dict[str, TaskTemplate] = field(default_factory=dict)  # planner / action / text
    chat_template: str = ""  # Jinja source, as in HF's tokenizer_config.json / chat_template.jinja
    special_tokens: Dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as the templates see them
    eos_tokens: Tuple[str, ...] = ()  # generation ends at any of these tokens
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} for Qwen3
    source: str = "prompts"  # where it was read, for messages
    # render_parts' marked texts of raw templates, by (task, which values are non-empty): see render_parts
    _marked: Dict[tuple, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def has(self, task: str) -> bool:
        return task in self.tasks

    def messages(self, task: str, **values: str) -> List[Dict[str, str]]:
        """The chat messages of a chat-form task template (system message only if the template has one)."""
        t = self.template(task)
        msgs = [{"role": "system", "content": self._task(task, "system", t.system, values)}] if t.system else []
        return msgs + [{"role": "user", "content": self._task(task, "user", t.user, values)}]

    def render(self, task: str, **values: str) -> str:
        """The prompt text of `task` for these request values (already checked by the caller)."""
        t = self.template(task)
        if not t.chat:
            return self._task(task, "raw", t.raw, values)
        return self.render_chat(self.messages(task, **values))

    def render_parts(self, task: str, fields: Optional[Dict[str, str]] = None, **values: str) -> RenderedPrompt:
        """`render` plus where each request value landed in the text (see RenderedPrompt). The template is
        rendered once more with a marker in place of each non-empty value (an empty one stays empty, so
        `{% if context %}` reads it); splicing the values back must give `render`'s text exactly.
        `fields`: the request field a value came from, when it is not the variable's name.

        A raw template that only prints its values and tests whether they are empty (`splices_values`: the
        zoo's) renders the same text for every request with the same empty / non-empty values, so its marked
        text is rendered once per such shape and kept: a request then costs one splice, no Jinja."""
        named = tuple((fields or {}).get(k, k) for k in values)
        keys = list(values)
        template = self.template(task)
        shape = (task, tuple((k, bool(v)) for k, v in values.items()))
        marked = self._marked.get(shape) if not template.chat else None
        if marked is None:
            marked = self.render(task, **{k: (_MARK.format(i) if v else v) for i, (k, v) in enumerate(values.items())})
            if not template.chat and splices_values(template.raw) and len(self._marked) < 64:
                self._marked[shape] = marked
            text = self.render(task, **values)
        else:
            text = None  # the splice is the rendered text (splices_values)
        pieces, spans, pos, at = [], [], 0, 0
        for m in _MARKS.finditer(marked):
            pieces.append(marked[pos:m.start()])
            at += m.start() - pos
            value = values[keys[int(m.group(1))]]
            pieces.append(value)
            spans.append((at, at + len(value)))
            at += len(value)
            pos = m.end()
        pieces.append(marked[pos:])
        pairs = tuple(zip(named, values.values()))
        spliced = "".join(pieces)
        if text is not None and spliced != text:
            return RenderedPrompt(text, (), pairs, exact=False)
        return RenderedPrompt(spliced, tuple(spans), pairs)

    def render_chat(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`, as transformers' apply_chat_template(tokenize=False) does."""
        if not self.chat_template:
            raise BundleError(f"{self.source}: no chat_template; a chat-form task template needs the model's chat "
                              "template (rebuild the bundle from a directory whose tokenizer_config.json or "
                              "chat_template.jinja has one, or pass `edgespec bundle --target DIR --out DIR --chat-template FILE`)")
        variables = {**self.special_tokens, **self.chat_template_kwargs}
        try:
            return _compiled(True, self.chat_template).render(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **variables)
        except jinja2.TemplateError as exc:
            raise BundleError(f"{self.source}: chat_template failed to render ({exc}); fix the template") from exc

    def template(self, task: str) -> TaskTemplate:
        if task not in self.tasks:
            raise BundleError(f"{self.source}: no {task} template; add a `{task}:` section ({{raw: ...}} or "
                              "{system: ..., user: ...}) with "
                              "`edgespec bundle --target DIR --out DIR --prompts FILE`"
                              + (f" or --{task}-template FILE" if task != "text" else "")
                              + " (see README, 'Your own model')")
        return self.tasks[task]

    def _task(self, task: str, key: str, source: str, values: Dict[str, str]) -> str:
        try:
            return _compiled(False, source).render(**self.special_tokens, **values)
        except jinja2.TemplateError as exc:
            raise BundleError(f"{self.source}: {task}.{key} failed to render ({exc}); fix the template") from exc

    def to_dict(self, chat_template_file: Optional[str] = None) -> Dict[str, Any]:
        """The bundle.yaml `prompts` section (the chat template itself goes to `chat_template_file`)."""
        d: Dict[str, Any] = {}
        if chat_template_file:
            d["chat_template"] = chat_template_file
        if self.special_tokens:
            d["special_tokens"] = dict(self.special_tokens)
        d["eos_tokens"] = list(self.eos_tokens)
        if self.chat_template_kwargs:
            d["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        d.update({task: t.to_dict() for task, t in self.tasks.items()})
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str, read_file: Optional[Callable[[str], str]] = None,
                  partial: bool = False) -> "PromptFormat":
        """Read and check a `prompts` section. `read_file(rel)` returns a bundle file's text (the chat template);
        without it `chat_template` is the template's source itself. `partial`: a user's section laid over the
        model's own (its chat template and special tokens may come from the model). Errors name `where`.key
        and what to do."""
        if not isinstance(d, dict):
            raise BundleError(f"{where}: got {d!r}, expected a mapping with keys among {list(FORMAT_KEYS)}")
        unknown = sorted(set(d) - set(FORMAT_KEYS))
        if unknown:
            raise BundleError(f"{where}.{unknown[0]}: unknown key; expected one of {list(FORMAT_KEYS)}")
        chat = d.get("chat_template") or ""
        if not isinstance(chat, str):
            raise BundleError(f"{where}.chat_template: got {chat!r}, expected a "
                              f"{'file name in the bundle' if read_file else 'Jinja template'}")
        if chat and read_file is not None:
            chat = read_file(chat)
        if chat:
            check_syntax(_CHAT_ENV, chat, f"{where}.chat_template")
        special = _string_map(d.get("special_tokens"), f"{where}.special_tokens")
        bad = sorted(set(special) - set(SPECIAL_TOKEN_NAMES))
        if bad:
            raise BundleError(f"{where}.special_tokens.{bad[0]}: unknown; expected some of {list(SPECIAL_TOKEN_NAMES)}")
        eos = d.get("eos_tokens", [])
        if not isinstance(eos, list) or not all(isinstance(e, str) and e for e in eos):
            raise BundleError(f"{where}.eos_tokens: got {eos!r}, expected a list of token strings (e.g. "
                              "['<|im_end|>', '<|endoftext|>'])")
        kwargs = d.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise BundleError(f"{where}.chat_template_kwargs: got {kwargs!r}, expected a mapping of template "
                              "variables (e.g. {enable_thinking: false})")
        tasks = {}
        for task in TASK_VARIABLES:
            if d.get(task) is not None:
                tasks[task] = task_template(d[task], task, f"{where}.{task}", None if partial else set(special))
                if tasks[task].chat and not chat and not partial:
                    raise BundleError(f"{where}.{task}: has system/user messages but the bundle has no chat_template; "
                                      "give the model's chat template (`edgespec bundle --target DIR --out DIR --chat-template FILE`) or "
                                      "write the whole prompt as `raw:`")
        return cls(tasks=tasks, chat_template=chat, special_tokens=special, eos_tokens=tuple(eos),
                   chat_template_kwargs=dict(kwargs), source=where)


def task_template(d: Any, task: str, where: str, special: Optional[set] = frozenset()) -> TaskTemplate:
    """A checked task template from its mapping: `raw`, or `user` with an optional `system`. `special`: the
    special tokens the model defines (None: not known yet)."""
    if not isinstance(d, dict):
        raise BundleError(f"{where}: got {d!r}, expected a mapping with `raw:` (the whole prompt) or `user:` "
                          "(and optionally `system:`) chat messages")
    unknown = sorted(set(d) - set(TEMPLATE_KEYS))
    if unknown:
        raise BundleError(f"{where}.{unknown[0]}: unknown key; expected `raw`, or `system` and `user`")
    for k, v in d.items():
        if not isinstance(v, str):
            raise BundleError(f"{where}.{k}: got {v!r}, expected a template string")
    t = TaskTemplate(**d)
    if bool(t.raw) == bool(t.user):
        raise BundleError(f"{where}: give either `raw:` (the whole prompt) or `user:` (a chat message, with an "
                          "optional `system:`), not " + ("both" if t.raw else "neither"))
    if t.raw and t.system:
        raise BundleError(f"{where}.system: only a chat-form template (`user:`) has a system message")
    allowed = set(TASK_VARIABLES[task]) | set(SPECIAL_TOKEN_NAMES)
    for k in TEMPLATE_KEYS:
        if getattr(t, k):
            used = check_syntax(_TASK_ENV, getattr(t, k), f"{where}.{k}")
            extra = sorted(used - allowed)
            if extra:
                raise BundleError(f"{where}.{k}: uses {extra[0]!r}, which a {task} request does not give; a {task} "
                                  f"template may use {list(TASK_VARIABLES[task])} and the special tokens "
                                  f"{list(SPECIAL_TOKEN_NAMES)}")
            missing = [n for n in used & set(SPECIAL_TOKEN_NAMES) if special is not None and n not in special]
            if missing:
                raise BundleError(f"{where}.{k}: uses {missing[0]!r}, which this model does not define "
                                  "(prompts.special_tokens); write the token itself")
    return t


@functools.lru_cache(maxsize=64)
def splices_values(source: str) -> bool:
    """Whether a task template only prints each request value as it is (`{{ name }}`, no filter, no
    attribute) and only tests it for emptiness (`{% if name %}`, `{% if not name %}`): then the text of a
    request is the text rendered with markers for its non-empty values, the values spliced back in.

    Worked examples: '<|bos|><|plan|>{{ instruction }}{% if context %}<|ctx|>{{ context }}{% endif %}<|sep|>'
    -> True; '{{ instruction | trim }}' -> False (a filter changes it); '{% if instruction == "x" %}' -> False."""
    try:
        ast = _TASK_ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    allowed = set()  # ids of the Name nodes used as a bare print or a bare truth test
    for output in ast.find_all(jinja2.nodes.Output):
        allowed.update(id(n) for n in output.nodes if isinstance(n, jinja2.nodes.Name))
    for cond in ast.find_all(jinja2.nodes.If):
        test = cond.test.node if isinstance(cond.test, jinja2.nodes.Not) else cond.test
        if isinstance(test, jinja2.nodes.Name):
            allowed.add(id(test))
    names = [n for n in ast.find_all(jinja2.nodes.Name) if n.name not in SPECIAL_TOKEN_NAMES]
    return all(id(n) in allowed for n in names) and not any(ast.find_all((jinja2.nodes.Assign, jinja2.nodes.For,
                                                                          jinja2.nodes.Macro, jinja2.nodes.Call)))


def check_syntax(env: jinja2.Environment, source: str, where: str) -> set:
    """Compile `source` (a BundleError naming `where` and the line if it is not valid Jinja); returns the
    variables it reads from outside."""
    try:
        ast = env.parse(source)
        env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise BundleError(f"{where}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return set(jinja2.meta.find_undeclared_variables(ast))


def _string_map(d: Any, where: str) -> Dict[str, str]:
    if d is None:
        return {}
    if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
        raise BundleError(f"{where}: got {d!r}, expected a mapping of names to token strings")
    return dict(d)
