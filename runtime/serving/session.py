"""A loaded model ready to serve requests: bundle + backend + drafter + tokenizer on one KV arena.

This is the API the CLI and the ROS 2 node use; it turns text requests (free generation, planner,
action tokens) into engine calls and checks every request before any work starts. Its pieces live beside it:
the request and result types (request_types.py), the checks it is assembled with (assembly.py), the grammar cache
(grammars.py), glibc's tuning (malloc.py), the draft shape (tuning.py)."""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from runtime.model import bundle as bundle_io
from runtime.memory import plan as memory
from runtime.text.actions import ActionTokenizer
from runtime.backends.factory import open_model, resolve_backend, say_once
from runtime.serving.assembly import check_taps, context_positions, eos_ids, prompt_format
from runtime.serving.blas import set_blas_threads
from runtime.serving.grammars import GrammarCache
from runtime.serving.malloc import return_freed_memory, return_large_blocks_on_free  # noqa: F401 (the node's main)
from runtime.serving.request_types import ActionResult, GenerationParams, GenerationResult, Partial, PlanResult
from runtime.config import RuntimeConfig
from runtime.drafters import registry
from runtime.decode.engine import DecodeStats, Engine, StopCheck
from runtime.errors import BudgetExceeded, BundleError, RequestError, RequestTooLong
from runtime.text.grammar import Grammar
from runtime.memory.kv import KVArena
from runtime.text.prompts import ACTION_CHUNK, action_request, parse_plan, plan_objects, planner_request
from runtime.serving.tuning import choose_shape, template_of, template_prefixes
from runtime.text.tokenizer import StreamDecoder, Tokenizer
from runtime.verify import verify_sampled
from runtime.verify_typical import lossy_verifier

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
        self._grammars = GrammarCache(b.path(b.tokenizer), spec.vocab_size, self.engine.eos)
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
        Compiled grammars are kept for the next requests (runtime/serving/grammars.py)."""
        return self._grammars.constraint(json_schema, grammar, field)

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
        grammar = self._grammars.token_run(at.allowed_token_ids(), n, "num_actions")
        with prompt_named({"instruction": instruction, "observation_text": observation_text}):
            _, tokens, finish, stats = self.generate_ids(ids, params, grammar=grammar)
        usable = len(tokens) - len(tokens) % at.dims
        actions = at.decode(tokens[:usable]) if usable else np.zeros((0, at.dims), np.float32)
        return ActionResult(list(tokens), actions, at.dims, finish, stats)
