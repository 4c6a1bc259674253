"""A loaded model ready to serve requests: bundle + backend + drafter + tokenizer on one KV arena.

This is the API the CLI and the ROS 2 node use; it turns text requests (free generation, planner,
action tokens) into engine calls and checks every request before any work starts."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from runtime.model import bundle as bundle_io
from runtime.memory import plan as memory
from runtime.text.actions import ActionTokenizer
from runtime.backends.factory import open_model, resolve_backend, say_once
from runtime.serving.blas import set_blas_threads
from runtime.config import MemoryConfig, RuntimeConfig
from runtime.drafters import registry
from runtime.drafters.base import Drafter
from runtime.decode.engine import DecodeStats, Engine, StopCheck
from runtime.errors import BudgetExceeded, BundleError, RequestError, RequestTooLong
from runtime.text.grammar import Grammar, GrammarTokenizer
from runtime.memory.kv import KVArena
from runtime.text.prompts import (ACTION_CHUNK, ZOO_PROMPTS, action_request, parse_plan, plan_objects,
                                  planner_request, zoo_tokens_in)
from runtime.sampling import SamplingParams
from runtime.serving.tuning import choose_shape, template_of, template_prefixes
from runtime.text.templates import PromptFormat
from runtime.text.tokenizer import StreamDecoder, Tokenizer
from runtime.verify import verify_sampled
from runtime.verify_typical import lossy_verifier

DRAFTER_CHOICES = bundle_io.BUILTIN_DRAFTERS  # every other drafter needs its entry in the bundle


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    deadline_s: Optional[float] = None  # seconds from the start of the request
    stop: Sequence[str] = ()

    def sampling(self, allowed_tokens=None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, allowed_tokens=allowed_tokens)

    def check(self) -> None:
        if self.deadline_s is not None and (not isinstance(self.deadline_s, (int, float)) or math.isnan(self.deadline_s)
                                            or self.deadline_s <= 0):
            raise RequestError("deadline_s", f"must be a number of seconds > 0 (or None), got {self.deadline_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise RequestError("seed", f"must be an integer >= 0, got {self.seed!r}")


@dataclass
class Partial:
    """What a request had decoded when it failed, set as `exc.partial` on the exception: exactly the text
    passed to on_delta so far (a streaming caller returns it with the error) and its token ids."""
    text: str
    token_ids: List[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str
    stats: DecodeStats


@dataclass
class PlanResult:
    text: str
    plan: Optional[list]
    plan_ok: bool
    plan_error: str
    objects: List[str]
    finish_reason: str
    stats: DecodeStats


@dataclass
class ActionResult:
    token_ids: List[int]
    actions: np.ndarray  # (num_actions, dims) float32
    dims: int
    finish_reason: str
    stats: DecodeStats


def check_taps(target, drafter: Optional[Drafter], backend: str, bundle_root: str) -> None:
    """Refuse, at session creation, a drafter that reads a hidden tap the target's backend does not produce
    (an ONNX graph exports only the taps named at export time; the numpy reference has them all)."""
    have = getattr(target, "tap_names", None)
    if drafter is None or have is None:
        return
    missing = [t for t in drafter.target_taps if t not in have]
    if missing:
        raise BundleError(f"drafter {drafter.kind!r} reads the target's hidden tap {missing[0]!r}, which the {backend} "
                          f"graph does not export (it has {list(have)}); re-export the ONNX graphs with `edgespec export "
                          f"--to onnx --bundle {bundle_root} --taps {' '.join(sorted(set(have) | set(drafter.target_taps)))}`"
                          + (" and rebuild the engines from them" if backend == "tensorrt" else ""))


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")  # glibc (Linux, Jetson); elsewhere the two functions below do nothing
    except OSError:
        return None


def return_large_blocks_on_free(threshold_bytes: int = 4 << 20) -> None:
    """Give every block from `threshold_bytes` up (weight tensors, the KV arena) its own mapping, unmapped
    when freed. By default glibc raises that threshold to 32 MB after the first such free and then serves
    these blocks from the malloc arena of the allocating thread, where a freed model stays resident: the
    ROS node, whose configure/cleanup run on whichever executor thread is free, grew 147 -> 289 MB over
    15 cycles. A fixed threshold also keeps glibc trimming freed heap tops. Process-wide: the process
    owner (the node's main) calls it."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, int(threshold_bytes))  # M_MMAP_THRESHOLD


def return_freed_memory() -> None:
    """Hand the free pages of every malloc arena back to the OS (malloc_trim)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def context_positions(mem: MemoryConfig, inp: memory.PlanInputs) -> int:
    """memory.max_context, held to the target's max_position_embeddings: the default is cut to it, a larger value
    given is refused (a ConfigError naming the key, the flag, the limit and the override), unless
    memory.exceed_max_position_embeddings asks for more by name."""
    inp = replace(inp, exceed_max_positions=mem.exceed_max_position_embeddings)
    limit = memory.context_limit(inp)
    if mem.max_context > limit and mem.max_context == MemoryConfig.max_context:
        return limit  # not asked for: the default of a model with a shorter window
    memory.check_context(inp, mem.max_context, "memory.max_context (--max-context)")
    return mem.max_context


def prompt_format(bundle, tokenizer: Tokenizer) -> PromptFormat:
    """The bundle's prompt format; a bundle from before it was recorded gets the zoo's when its tokenizer has
    the zoo's task tokens, else none (a planner request then says what to add)."""
    if bundle.prompts is not None:
        return bundle.prompts
    if zoo_tokens_in(tokenizer):
        return ZOO_PROMPTS
    return PromptFormat(source=f"{bundle.path('bundle.yaml')}: prompts")


def eos_ids(bundle, prompts: PromptFormat, tokenizer: Tokenizer) -> List[int]:
    """Every token id that ends an answer: the config's eos_token_id(s) and the prompt format's eos_tokens."""
    eos = set(bundle.target.spec.eos_token_ids)
    for token in prompts.eos_tokens:
        tid = tokenizer.token_to_id(token)
        if tid is None:
            raise BundleError(f"{prompts.source}.eos_tokens: {token!r} is not a token of {bundle.tokenizer}; "
                              "rebuild the bundle (`edgespec bundle --target DIR --out DIR --prompts FILE`) "
                              "naming a token the tokenizer has")
        eos.add(int(tid))
    return sorted(eos)


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


class Session:
    """One model, one drafter, one KV arena. Requests run one at a time (batch 1)."""

    def __init__(self, config: RuntimeConfig):
        self.config = config
        if config.backend.blas_threads:
            set_blas_threads(config.backend.blas_threads)
        self.bundle = bundle_io.load(config.bundle)
        b = self.bundle
        self._stamps = bundle_io.file_stamps(b)  # what was loaded, to notice a bundle changed under a running node
        backend = replace(config.backend, kind=resolve_backend(config.backend.kind, b, config.backend.precision))
        if backend.kind == "gguf":  # the quant by name from here on: the draft model's GGUF and the plan read it
            backend = replace(backend, precision=b.gguf_quant(backend.precision))
        self.tokenizer = Tokenizer(b.path(b.tokenizer))
        spec = b.target.spec
        name = config.drafter.kind if config.drafter.kind != "auto" else b.default_drafter
        if name not in b.drafter_choices():
            raise RequestError("drafter", b.missing_drafter(name))
        # Fixed or adaptive draft shapes (runtime/serving/tuning.py); a tuned shape may draft deeper than num_tokens.
        try:
            precision_key = (b.onnx_target(backend.precision) if backend.kind == "onnx" else
                             b.target_files(backend.kind)).params.get("precision", backend.precision)
        except BundleError:  # the backend's own files are checked (and refused, by name) further down
            precision_key = backend.precision
        self.shape = choose_shape(config.drafter.shape, config.bundle, backend.kind, str(precision_key), name,
                                  config.drafter.num_tokens)
        self.shape_precision = str(precision_key)  # what a tune of this session is keyed by, with backend and machine
        if self.shape.note:  # a tune of another machine: said once, not used
            say_once(f"edgespec: {self.shape.note}")
        num_tokens = self.shape.num_tokens
        # The plan (runtime/memory/plan.py) sizes the arena; an over-budget session is refused before any allocation.
        shapes = registry.cache_shapes(b, name)
        tree_tokens = registry.tree_tokens(b, name, num_tokens, config.drafter.branching)
        self.plan_inputs = registry.plan_inputs(b, name, backend.kind, tree_tokens, backend.precision,
                                                config.memory.prefill_chunk,
                                                config.memory.exceed_max_position_embeddings)
        positions = wanted = context_positions(config.memory, self.plan_inputs)
        self.budget_bytes = int(config.memory.budget_mb * 2**20)
        if self.budget_bytes > 0:
            fit = memory.max_context(self.plan_inputs, self.budget_bytes)
            if fit < memory.MIN_CONTEXT:
                raise BudgetExceeded(memory.over_budget(self.plan_inputs, self.budget_bytes, memory.MIN_CONTEXT,
                                                        "this bundle"))
            positions = min(positions, fit)
        # A request longer than this is refused by the budget (not by max_context) before it runs.
        self.budget_positions = positions if self.budget_bytes > 0 and positions < wanted else None
        # backend.precision picks the ONNX target graph (the float one, or a quantised one that then IS the target)
        files = (b.onnx_target(backend.precision) if backend.kind == "onnx" else
                 b.target_files(b.target_entry_key(backend.kind, backend.precision)))
        # (numpy drafters sharing an fp16 arena read it upcast; only the drafter's precision is affected, not exactness)
        kv_dtype = np.float16 if files.params.get("precision") == "fp16" else np.float32
        # + drafted rows: a drafter's cache holds the context plus the branch it is drafting
        self.arena = KVArena.for_context(shapes, positions + memory.DRAFT_SLACK, dtype=kv_dtype)
        cache = self.arena.allocate("target", shapes["target"], positions)
        # The hidden states the drafter reads: a backend that cannot give one refuses here, at session creation.
        taps = b.drafters[name].target_taps if name in b.drafters else ()
        self.target = open_model(b, spec, files, backend, cache, taps=taps)
        self.drafter = registry.build_drafter(name, b, backend, self.arena, positions, num_tokens,
                                     config.drafter.branching, getattr(self.target, "w", None))
        check_taps(self.target, self.drafter, backend.kind, config.bundle)
        self.drafter_kind = name
        self.backend_name = backend.kind
        self.prompts = prompt_format(b, self.tokenizer)
        # decoding.lossy_typical_acceptance: the one LOSSY option, asked for by name (sampled requests only)
        verifier = (lossy_verifier(config.decoding.typical_epsilon, config.decoding.typical_delta)
                    if config.decoding.lossy_typical_acceptance else verify_sampled)
        self.engine = Engine(self.target, self.drafter, eos_ids(b, self.prompts, self.tokenizer),
                             sampled_verifier=verifier, prefix_cache=config.memory.prefix_cache,
                             policy=self.shape.policy, shape=self.shape.label,
                             prefill_chunk=config.memory.prefill_chunk)
        self._actions: Optional[ActionTokenizer] = None
        self._prefixes: Optional[list] = None  # the prompt templates' fixed starts (template_of), when first needed
        self._grammar_tokenizer: Optional[GrammarTokenizer] = None
        self._grammars: Dict[tuple, Grammar] = {}  # compiled grammars by (kind, text), the most recent few
        # Measured once: the files it reads may be replaced or deleted while the model, loaded, serves on.
        self._memory_bytes = self._measure_memory()

    @classmethod
    def open(cls, bundle_dir: str, drafter: Optional[str] = None, backend: Optional[str] = None,
             max_context: Optional[int] = None, num_tokens: Optional[int] = None,
             prefix_cache: Optional[bool] = None, shape: Optional[str] = None) -> "Session":
        cfg = RuntimeConfig(bundle=bundle_dir)
        if drafter is not None:
            cfg = replace(cfg, drafter=replace(cfg.drafter, kind=drafter))
        if shape is not None:  # auto | fixed | adaptive, checked by tuning.choose_shape
            cfg = replace(cfg, drafter=replace(cfg.drafter, shape=shape))
        if num_tokens is not None:
            cfg = replace(cfg, drafter=replace(cfg.drafter, num_tokens=num_tokens))
        if backend is not None:
            cfg = replace(cfg, backend=replace(cfg.backend, kind=backend))
        if max_context is not None:
            cfg = replace(cfg, memory=replace(cfg.memory, max_context=max_context))
        if prefix_cache is not None:
            cfg = replace(cfg, memory=replace(cfg.memory, prefix_cache=prefix_cache))
        return cls(cfg)

    def template_of(self, prompt_ids: Sequence[int]) -> Optional[str]:
        """Which of the bundle's prompt templates a prompt was made with (planner, action, text), by its fixed
        start: the adaptive draft shape keeps its acceptance per template."""
        if self.engine.policy is None:
            return None
        if self._prefixes is None:
            self._prefixes = template_prefixes(self.prompts, self.tokenizer.encode)
        return template_of(prompt_ids, self._prefixes)

    def memory_in_use(self) -> int:
        """Bytes held: the KV arena, the target's weights and the drafter's (measured at load)."""
        return self._memory_bytes

    def _measure_memory(self) -> int:
        weights = int(getattr(self.target, "weight_bytes", 0))
        draft = self.drafter.memory_bytes if self.drafter else 0
        return self.arena.capacity_bytes + weights + draft

    def changed_files(self) -> List[str]:
        """Bundle files changed or removed on disk since this session loaded them (it serves on from memory;
        a new session loads the new ones). Costs one stat per file."""
        return bundle_io.changed_files(self.bundle, self._stamps)

    @property
    def actions(self) -> ActionTokenizer:
        if self._actions is None:
            self._actions = ActionTokenizer.from_tokenizer(self.tokenizer)
        return self._actions

    def grammar(self, json_schema=None, grammar: Optional[str] = None, field: Optional[str] = None) -> Optional[Grammar]:
        """Compile a request's constraint (JSON Schema as dict or text, or a Lark grammar); None if neither.
        Compiled grammars are kept for the next requests (a robot sends the same schema again and again)."""
        if json_schema is not None and grammar is not None:
            raise RequestError(field or "grammar", "send either a JSON Schema or a Lark grammar, not both")
        if json_schema is None and grammar is None:
            return None
        if grammar is not None:
            return self._compiled(("lark", grammar),
                                  lambda: Grammar.from_lark(grammar, self._grammar_tok(), field or "grammar"))
        key = ("json", json_schema if isinstance(json_schema, str) else json.dumps(json_schema, sort_keys=True))
        return self._compiled(key, lambda: Grammar.from_json_schema(json_schema, self._grammar_tok(),
                                                                     field or "json_schema"))

    def _grammar_tok(self) -> GrammarTokenizer:
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.bundle.path(self.bundle.tokenizer),
                                                       self.target.spec.vocab_size, self.engine.eos)
        return self._grammar_tokenizer

    def _compiled(self, key: tuple, compile_: Callable[[], Grammar]) -> Grammar:
        """The grammar compiled for `key`, from the last few requests' if there (most recent last)."""
        hit = self._grammars.pop(key, None)
        if hit is None:
            hit = compile_()
        self._grammars[key] = hit
        while len(self._grammars) > 8:
            self._grammars.pop(next(iter(self._grammars)))
        return hit

    def close(self) -> None:
        """Release the model (weights, KV arena, backend sessions), also while the caller still holds this
        object, and hand the freed pages back to the OS."""
        self.target = None
        self.drafter = None
        self.engine = None
        self.arena = None
        gc.collect()
        return_freed_memory()

    def warm_up(self) -> DecodeStats:
        """One short request through the configured backend and drafter, EOS masked so that a cycle with a
        draft is sure to run: a combination that cannot serve (e.g. an fp16 graph fed float32 by a drafter)
        fails here, at start-up, instead of on every request. Also pays the backend's first-run allocations."""
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

        def on_tokens(batch: List[int]) -> None:
            emitted.extend(batch)
            state["n"] += len(batch)
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
            exc.partial = Partial(decoder.text, list(emitted))
            raise
        out.stats.memory_bytes = self.memory_in_use()
        out.stats.drafter = self.drafter_kind  # the name the user chose (eagle3_chain), not its kind (eagle3)
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
        grammar = self._compiled(("actions", n), lambda: Grammar.token_run(at.allowed_token_ids(), n,
                                                                           self._grammar_tok(), "num_actions"))
        with prompt_named({"instruction": instruction, "observation_text": observation_text}):
            _, tokens, finish, stats = self.generate_ids(ids, params, grammar=grammar)
        usable = len(tokens) - len(tokens) % at.dims
        actions = at.decode(tokens[:usable]) if usable else np.zeros((0, at.dims), np.float32)
        return ActionResult(list(tokens), actions, at.dims, finish, stats)
