"""A loaded model ready to serve requests: bundle + backend + drafter + tokenizer on one KV arena.

This is the API the CLI and the ROS 2 node use; it turns text requests (free generation, planner,
action tokens) into engine calls and checks every request before any work starts. Its pieces live beside it:
the request and result types (request_types.py), the model it serves, assembled from the config with its checks
(assembly.py: AssembledModel, which Session extends with the request API), the grammar cache
(grammars.py), glibc's tuning (malloc.py), the draft shape (tuning.py)."""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from runtime.model import bundle as bundle_io
from runtime.memory import plan as memory
from runtime.text.actions import ActionTokenizer
from runtime.serving.assembly import AssembledModel, check_taps, context_positions, prompt_format  # noqa: F401 (importers)
from runtime.serving.malloc import return_large_blocks_on_free  # noqa: F401 (the node's main)
from runtime.serving.request_types import ActionResult, GenerationParams, GenerationResult, Partial, PlanResult
from runtime.decode.engine import DecodeStats, StopCheck
from runtime.errors import RequestError, RequestTooLong
from runtime.text.grammar import Grammar
from runtime.text.prompts import ACTION_CHUNK, action_request, parse_plan, plan_objects, planner_request
from runtime.serving.tuning import template_of, template_prefixes
from runtime.text.tokenizer import StreamDecoder

DRAFTER_CHOICES = bundle_io.BUILTIN_DRAFTERS  # every other drafter needs its entry in the bundle


@contextlib.contextmanager
def prompt_named(fields: Dict[str, str]):
    """A refusal of the prompt (too long for the context or the budget) names the request field it came from:
    a Plan or ActionTokens request has no `prompt`. The longest field is the one to shorten, also when the
    template's own tokens are what fills a tiny context."""
    try:
        yield
    except RequestError as exc:
        if exc.field != "prompt":
            raise
        name = max((k for k in fields if fields[k]), key=lambda k: len(fields[k]), default="instruction")
        detail = str(exc).split(": ", 1)[-1]
        raise type(exc)(name, f"is {len(fields[name])} characters, the longest part of the prompt, which {detail}") from None


class Session(AssembledModel):
    """One model, one drafter, one KV arena (assembled from its config by runtime/serving/assembly.py).
    Requests run one at a time (batch 1)."""

    def template_of(self, prompt_ids: Sequence[int]) -> Optional[str]:
        """Which of the bundle's prompt templates a prompt was made with (planner, action, text), by its fixed
        start: the adaptive draft shape keeps its acceptance per template."""
        if self.engine.policy is None:
            return None
        if self._prefixes is None:
            self._prefixes = template_prefixes(self.prompts, self.tokenizer.encode)
        return template_of(prompt_ids, self._prefixes)

    @property
    def actions(self) -> ActionTokenizer:
        if self._actions is None:
            self._actions = ActionTokenizer.from_tokenizer(self.tokenizer)
        return self._actions

    def grammar(self, json_schema=None, grammar: Optional[str] = None, field: Optional[str] = None) -> Optional[Grammar]:
        """Compile a request's constraint (JSON Schema as dict or text, or a Lark grammar); None if neither.
        Compiled grammars are kept for the next requests (runtime/serving/grammars.py)."""
        return self._grammars.constraint(json_schema, grammar, field)

    def warm_up(self, prompt: Optional[str] = None) -> DecodeStats:
        """One short request through the configured backend and drafter, EOS masked so that a cycle with a
        draft is sure to run: a combination that cannot serve (e.g. an fp16 graph fed float32 by a drafter)
        fails here, at start-up, instead of on every request (with `prompt`, 4 tokens after it first: a real
        request's shapes and caches). Also pays the backend's first-run allocations, which the adaptive rule
        does not learn from: its state (acceptance, cost scales, vetoes) is kept as it was, since a first run's
        costs are not this machine's (measured on the zoo: a draft model's first drafting cycle 5-14 ms against
        2.5-3 ms later; a first 1-row verify 5-6 plain steps, enough to veto a template that pays)."""
        policy = copy.deepcopy(self.engine.policy)
        try:
            if prompt is not None:
                self.generate(prompt, GenerationParams(max_tokens=4))
            return self._warm_up()
        finally:
            self.engine.policy = policy

    def _warm_up(self) -> DecodeStats:
        eos = set(self.engine.eos)
        others = tuple(t for t in range(self.bundle.target.spec.vocab_size) if t not in eos)
        ids = self.tokenizer.encode("ready") or [others[0]]
        steps = 2 + max(2, self.config.drafter.num_tokens)  # prefill's token, then a cycle with room to draft
        _, _, _, stats = self.generate_ids(ids, GenerationParams(max_tokens=steps), allowed_tokens=others)
        return stats

    # -- requests ---------------------------------------------------------------------------------

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams, allowed_tokens=None,
                     on_delta: Optional[Callable[[str, int], None]] = None,
                     should_stop: Optional[Callable[[], bool]] = None, grammar: Optional[Grammar] = None):
        """Decode after token ids (constrained by `grammar` if given); returns (text, ids, finish_reason, stats)."""
        params.check()
        need = len(prompt_ids) + params.max_tokens
        if self.budget_positions is not None and need > self.budget_positions and isinstance(params.max_tokens, int):
            raise RequestTooLong("prompt", memory.over_budget(
                self.plan_inputs, self.budget_bytes, need, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens})"))
        start = time.monotonic()
        decoder = StreamDecoder(self.tokenizer)
        state = {"n": 0, "stopped": False}
        emitted: List[int] = []
        # Text as it grows only for a stream or a stop string; otherwise decoded once at the end (push decodes
        # every id so far: per token, that is quadratic in the answer's length)
        incremental = on_delta is not None or bool(params.stop)

        def on_tokens(batch: List[int]) -> None:
            emitted.extend(batch)
            state["n"] += len(batch)
            if not incremental:
                return
            delta = decoder.push(batch)
            if params.stop and any(s in decoder.text for s in params.stop):
                state["stopped"] = True
            if on_delta is not None and delta:
                on_delta(delta, state["n"])

        def why_stop() -> Optional[str]:
            if should_stop is not None and should_stop():
                return "cancelled"
            return "stop" if state["stopped"] else None

        deadline = start + params.deadline_s if params.deadline_s else None
        try:
            out = self.engine.generate(prompt_ids, params.sampling(allowed_tokens), params.max_tokens, params.seed,
                                       on_tokens, StopCheck(deadline, why_stop), grammar=grammar,
                                       template=self.template_of(prompt_ids))
        except Exception as exc:  # a backend failure mid-stream: the caller may have streamed text already
            if not incremental:
                decoder.push(emitted)  # the text a stream would have had by now
            exc.partial = Partial(decoder.text, list(emitted))
            raise
        out.stats.memory_bytes = self.memory_in_use()
        out.stats.drafter = self.drafter_kind  # the name the user chose (eagle3_chain), not its kind (eagle3)
        if not incremental:
            decoder.ids.extend(emitted)
        tail = decoder.flush()
        if on_delta is not None and tail:
            on_delta(tail, state["n"])
        text = decoder.text
        if out.finish_reason == "stop":
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            text = text[:cut] if cut >= 0 else text
        return text, out.tokens, out.finish_reason, out.stats

    def generate(self, prompt: str, params: GenerationParams = GenerationParams(),
                 on_delta: Optional[Callable[[str, int], None]] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 json_schema=None, grammar: Optional[str] = None) -> GenerationResult:
        """`json_schema` (dict or JSON text) or `grammar` (Lark text) constrain the answer (runtime/text/grammar.py)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("prompt", "is empty; give the text to continue")
        constraint = self.grammar(json_schema, grammar)
        ids = self.tokenizer.encode(prompt)
        text, tokens, finish, stats = self.generate_ids(ids, params, None, on_delta, should_stop, constraint)
        return GenerationResult(text, tokens, finish, stats)

    def plan(self, instruction: str, context: str = "", params: GenerationParams = GenerationParams(),
             on_delta: Optional[Callable[[str, int], None]] = None, schema=None, observation: str = "") -> PlanResult:
        """`schema` (a JSON Schema, dict or text; configs/plan_schema.json is the zoo's) makes every plan valid
        by construction, unless max_tokens cuts it short (finish_reason "max_tokens"). `observation` (text)
        joins the context as 'Observation: ...'."""
        constraint = self.grammar(schema, None, "schema")
        fields = {"instruction": instruction, "context": context, "observation": observation}
        joined = "\n".join(s for s in (context, observation and f"Observation: {observation}") if s)
        ids = self.tokenizer.encode_prompt(planner_request(instruction, joined, self.prompts,
                                                           "context" if context else "observation"))
        with prompt_named(fields):
            text, _, finish, stats = self.generate_ids(ids, params, on_delta=on_delta, grammar=constraint)
        try:
            steps = parse_plan(text)
            return PlanResult(text, steps, True, "", sorted(plan_objects(steps)), finish, stats)
        except RequestError as exc:
            return PlanResult(text, None, False, str(exc), [], finish, stats)

    def action_tokens(self, instruction: str, observation: Sequence[float] = (), observation_text: str = "",
                      num_actions: int = ACTION_CHUNK, params: GenerationParams = GenerationParams()) -> ActionResult:
        if isinstance(num_actions, bool) or not isinstance(num_actions, (int, np.integer)) or not 1 <= num_actions <= 64:
            raise RequestError("num_actions", f"must be an integer in [1, 64], got {num_actions!r}")
        if observation_text and len(observation):
            raise RequestError("observation_text", "is set and so is observation: send only one of them "
                                                   "(observation: the numbers; observation_text: the same as text)")
        obs = observation_text if observation_text else list(observation)  # the numbers are checked by the prompt
        ids = self.tokenizer.encode_prompt(action_request(instruction, obs, self.prompts))
        at = self.actions
        # Exactly num_actions * dims action-bin tokens then EOS: the trivial grammar, masked like any other
        # (on every verify row and on the drafter's q). max_tokens ends the answer before its EOS.
        n = num_actions * at.dims
        params = replace(params, max_tokens=n, stop=())
        grammar = self._grammars.token_run(at.allowed_token_ids(), n, "num_actions")
        with prompt_named({"instruction": instruction, "observation_text": observation_text}):
            _, tokens, finish, stats = self.generate_ids(ids, params, grammar=grammar)
        usable = len(tokens) - len(tokens) % at.dims
        actions = at.decode(tokens[:usable]) if usable else np.zeros((0, at.dims), np.float32)
        return ActionResult(list(tokens), actions, at.dims, finish, stats)
