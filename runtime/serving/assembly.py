"""A Session's model assembled from its config (`AssembledModel`: backend, draft shape, memory plan, KV arena,
target, drafter, engine; its lifecycle), and the pieces it is assembled from, each checked at creation: the context
its arena holds (the plan, held to the target's window), the drafter's taps against what the target's backend
produces, the prompt format and the token ids that end an answer."""
from __future__ import annotations

import gc
from dataclasses import replace
from typing import List, Optional

import numpy as np

from runtime.backends.factory import open_model, resolve_backend, say_once
from runtime.config import MemoryConfig, RuntimeConfig
from runtime.decode.engine import Engine
from runtime.drafters import registry
from runtime.drafters.base import Drafter
from runtime.errors import BudgetExceeded, BundleError, RequestError
from runtime.memory import plan as memory
from runtime.memory.kv import KVArena
from runtime.model import bundle as bundle_io
from runtime.serving.blas import set_blas_threads
from runtime.serving.grammars import GrammarCache
from runtime.serving.malloc import return_freed_memory
from runtime.serving.tuning import choose_shape
from runtime.text.actions import ActionTokenizer
from runtime.text.prompts import ZOO_PROMPTS, zoo_tokens_in
from runtime.text.templates import PromptFormat
from runtime.text.tokenizer import Tokenizer
from runtime.verify import verify_sampled
from runtime.verify_typical import lossy_verifier


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


class AssembledModel:
    """A bundle's model assembled from a RuntimeConfig: the backend, the draft shape, the memory plan sizing one KV
    arena (an over-budget one refused before any allocation), the target on it, the drafter, the engine, the
    prompt format; its lifecycle (memory held, files changed on disk, close). The request API is Session's."""

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
            raise RequestError("drafter", registry.missing_drafter(b, name))
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
                                                config.memory.exceed_max_position_embeddings, backend.providers,
                                                config.drafter.branching)
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
             prefix_cache: Optional[bool] = None, shape: Optional[str] = None) -> "AssembledModel":
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

    def close(self) -> None:
        """Release the model (weights, KV arena, backend sessions), also while the caller still holds this
        object, and hand the freed pages back to the OS."""
        self.target = None
        self.drafter = None
        self.engine = None
        self.arena = None
        gc.collect()
        return_freed_memory()
