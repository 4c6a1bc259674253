"""A loaded model ready to serve requests: bundle + backend + drafter + tokenizer on one KV arena.

This is the API the CLI and the ROS 2 node use; it turns text requests (free generation, planner,
action tokens) into engine calls and checks every request before any work starts."""
from __future__ import annotations

import ctypes
import gc
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence

import numpy as np

from runtime import bundle as bundle_io
from runtime import memory
from runtime.actions import ActionTokenizer
from runtime.backends.factory import load_weights, open_model, resolve_backend
from runtime.backends.numpy_ref import cache_shape
from runtime.blas import set_blas_threads
from runtime.bundle import BackendFiles
from runtime.config import BackendConfig, RuntimeConfig
from runtime.drafters.base import Drafter
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.mtp import MTPDrafter, mtp_cache_shape
from runtime.drafters.ngram import NgramDrafter
from runtime.engine import DecodeStats, Engine, StopCheck
from runtime.errors import BudgetExceeded, BundleError, RequestError
from runtime.kv import KVArena
from runtime.prompts import ACTION_CHUNK, EOS, action_prompt, parse_plan, plan_objects, planner_prompt
from runtime.sampling import SamplingParams
from runtime.tokenizer import StreamDecoder, Tokenizer

DRAFTER_CHOICES = ("none", "ngram", "draft_model")


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


def build_drafter(name: str, bundle, backend: BackendConfig, arena: KVArena, max_positions: int,
                  num_tokens: int, branching: int, target_weights=None) -> Optional[Drafter]:
    if name == "none":
        return None
    if name == "ngram":
        params = bundle.drafters["ngram"].params if "ngram" in bundle.drafters else {}
        return NgramDrafter(num_tokens=num_tokens, max_n=int(params.get("max_n", 3)), min_n=int(params.get("min_n", 1)),
                            branching=branching)
    entry = bundle.drafter(name)
    if entry.kind == "draft_model":
        files = entry.backends.get(backend.kind) if backend.kind != "numpy_ref" else None
        files = files or BackendFiles(files=entry.files)
        if backend.kind != "numpy_ref" and backend.kind not in entry.backends:
            backend = replace(backend, kind="numpy_ref")  # no graph for this backend: run the draft in numpy
        cache = arena.allocate("draft", cache_shape(entry.spec), max_positions)
        model = open_model(bundle, entry.spec, files, backend, cache, label=f"drafter {name}")
        return DraftModelDrafter(model, num_tokens=num_tokens, branching=branching)
    if entry.kind == "mtp":
        weights = load_weights(bundle, entry.files)
        target_w = target_weights if target_weights is not None else load_weights(bundle, bundle.target_files("numpy_ref").files)
        spec = bundle.target.spec
        embed = np.ascontiguousarray(target_w["model.embed_tokens.weight"], np.float32)
        head = embed if spec.tie_word_embeddings else np.ascontiguousarray(target_w["lm_head.weight"], np.float32)
        cache = arena.allocate("mtp", mtp_cache_shape(spec), max_positions + num_tokens)
        return MTPDrafter(spec, weights, embed, head, cache, num_tokens=num_tokens,
                          layer_index=int(entry.params.get("first_layer_index", spec.num_layers)))
    raise BundleError(f"drafter kind {entry.kind!r} is not available in this runtime yet")


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


class Session:
    """One model, one drafter, one KV arena. Requests run one at a time (batch 1)."""

    def __init__(self, config: RuntimeConfig):
        self.config = config
        if config.backend.blas_threads:
            set_blas_threads(config.backend.blas_threads)
        self.bundle = bundle_io.load(config.bundle)
        b = self.bundle
        backend = replace(config.backend, kind=resolve_backend(config.backend.kind, b))
        self.tokenizer = Tokenizer(b.path(b.tokenizer))
        spec = b.target.spec
        name = config.drafter.kind if config.drafter.kind != "auto" else b.default_drafter
        if name not in DRAFTER_CHOICES and name not in b.drafters:
            raise RequestError("drafter", f"unknown drafter {name!r}; choose one of "
                                          f"{sorted(set(DRAFTER_CHOICES) | set(b.drafters))}")
        # The plan (runtime/memory.py) sizes the arena; an over-budget session is refused before any allocation.
        shapes = memory.bundle_cache_shapes(b, name)
        self.plan_inputs = memory.bundle_inputs(b, name, backend.kind,
                                                config.drafter.num_tokens * config.drafter.branching + 1)
        positions = config.memory.max_context
        self.budget_bytes = int(config.memory.budget_mb * 2**20)
        if self.budget_bytes > 0:
            fit = memory.max_context(self.plan_inputs, self.budget_bytes)
            if fit < memory.MIN_CONTEXT:
                raise BudgetExceeded(memory.over_budget(self.plan_inputs, self.budget_bytes, memory.MIN_CONTEXT,
                                                        "this bundle"))
            positions = min(positions, fit)
        # A request longer than this is refused by the budget (not by max_context) before it runs.
        self.budget_positions = positions if self.budget_bytes > 0 and positions < config.memory.max_context else None
        files = b.target_files(backend.kind)
        # (numpy drafters sharing an fp16 arena read it upcast; only the drafter's precision is affected, not exactness)
        kv_dtype = np.float16 if memory.bundle_kv_bytes(b, backend.kind) == 2 else np.float32
        # + drafted rows: a drafter's cache holds the context plus the branch it is drafting
        self.arena = KVArena.for_context(shapes, positions + memory.DRAFT_SLACK, dtype=kv_dtype)
        cache = self.arena.allocate("target", shapes["target"], positions)
        # The hidden states the drafter reads: a backend that cannot give one refuses here, at session creation.
        taps = b.drafters[name].target_taps if name in b.drafters else ()
        self.target = open_model(b, spec, files, backend, cache, taps=taps)
        self.drafter = build_drafter(name, b, backend, self.arena, positions, config.drafter.num_tokens,
                                     config.drafter.branching, getattr(self.target, "w", None))
        self.drafter_kind = name
        self.backend_name = backend.kind
        eos = set(spec.eos_token_ids)
        eos_id = self.tokenizer.token_to_id(EOS)
        if eos_id is not None:
            eos.add(eos_id)
        self.engine = Engine(self.target, self.drafter, sorted(eos))
        self._actions: Optional[ActionTokenizer] = None

    @classmethod
    def open(cls, bundle_dir: str, drafter: Optional[str] = None, backend: Optional[str] = None,
             max_context: Optional[int] = None, num_tokens: Optional[int] = None) -> "Session":
        cfg = RuntimeConfig(bundle=bundle_dir)
        if drafter is not None:
            cfg = replace(cfg, drafter=replace(cfg.drafter, kind=drafter))
        if num_tokens is not None:
            cfg = replace(cfg, drafter=replace(cfg.drafter, num_tokens=num_tokens))
        if backend is not None:
            cfg = replace(cfg, backend=replace(cfg.backend, kind=backend))
        if max_context is not None:
            cfg = replace(cfg, memory=replace(cfg.memory, max_context=max_context))
        return cls(cfg)

    def memory_in_use(self) -> int:
        weights = int(getattr(self.target, "weight_bytes", 0))
        draft = self.drafter.memory_bytes if self.drafter else 0
        return self.arena.capacity_bytes + weights + draft

    @property
    def actions(self) -> ActionTokenizer:
        if self._actions is None:
            self._actions = ActionTokenizer.from_tokenizer(self.tokenizer)
        return self._actions

    def close(self) -> None:
        """Release the model (weights, KV arena, backend sessions), also while the caller still holds this
        object, and hand the freed pages back to the OS."""
        self.target = None
        self.drafter = None
        self.engine = None
        self.arena = None
        gc.collect()
        return_freed_memory()

    # -- requests ---------------------------------------------------------------------------------

    def generate_ids(self, prompt_ids: Sequence[int], params: GenerationParams, allowed_tokens=None,
                     on_delta: Optional[Callable[[str, int], None]] = None,
                     should_stop: Optional[Callable[[], bool]] = None):
        """Decode after token ids; returns (text, ids, finish_reason, stats)."""
        params.check()
        need = len(prompt_ids) + params.max_tokens
        if self.budget_positions is not None and need > self.budget_positions and isinstance(params.max_tokens, int):
            raise BudgetExceeded(memory.over_budget(self.plan_inputs, self.budget_bytes, need,
                                                    f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens})"))
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
                                       on_tokens, StopCheck(deadline, why_stop))
        except Exception as exc:  # a backend failure mid-stream: the caller may have streamed text already
            exc.partial = Partial(decoder.text, list(emitted))
            raise
        out.stats.memory_bytes = self.memory_in_use()
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
                 should_stop: Optional[Callable[[], bool]] = None) -> GenerationResult:
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("prompt", "is empty; give the text to continue")
        ids = self.tokenizer.encode(prompt)
        text, tokens, finish, stats = self.generate_ids(ids, params, None, on_delta, should_stop)
        return GenerationResult(text, tokens, finish, stats)

    def plan(self, instruction: str, context: str = "", params: GenerationParams = GenerationParams(),
             on_delta: Optional[Callable[[str, int], None]] = None) -> PlanResult:
        ids = self.tokenizer.encode(planner_prompt(instruction, context))
        text, _, finish, stats = self.generate_ids(ids, params, on_delta=on_delta)
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
        ids = self.tokenizer.encode(action_prompt(instruction, obs))
        at = self.actions
        # Exactly num_actions * dims tokens, all restricted to action bins (the same mask on p and q).
        params = replace(params, max_tokens=num_actions * at.dims, stop=())
        _, tokens, finish, stats = self.generate_ids(ids, params, tuple(int(t) for t in at.allowed_token_ids()))
        usable = len(tokens) - len(tokens) % at.dims
        actions = at.decode(tokens[:usable]) if usable else np.zeros((0, at.dims), np.float32)
        return ActionResult(list(tokens), actions, at.dims, finish, stats)
