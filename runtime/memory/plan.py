"""The memory plan: what a target + drafter need on one device, row by row, and the longest context a budget holds.

On Jetson the GPU and the CPU share one memory, so a single budget covers everything the process holds:

    total(context) = target weights + drafter weights            (fixed)
                   + KV bytes per position x (context + DRAFT_SLACK)
                   + forward scratch (the largest forward: a prefill chunk of memory.prefill_chunk tokens, or a
                     tree verify) + the drafter's own forward scratch where it runs a graph of its own
                   + runtime overhead (interpreter, libraries, CUDA context)  + headroom (a share of the budget)

Everything here is pure arithmetic on model dimensions (`ModelDims`, read from an HF config.json or a bundle's
spec); the Session sizes its KV arena from `max_context` and refuses what does not fit before allocating. Units:
bytes everywhere; GB = 1e9 and GiB = 2**30 when parsing, device profiles' memory_gb is GiB (module sizes are
powers of two), budget_mb and reserved_mb are MiB. Budgets and device profiles: runtime/memory/devices.py; a
bundle's sizes and the plan's inputs read from it: runtime/memory/bundle_sizes.py."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from runtime.config import MemoryConfig
from runtime.errors import ConfigError
from runtime.memory.kv import CacheShape

GiB, MiB = 1 << 30, 1 << 20
DRAFT_SLACK = 64  # rows each cache holds beyond the context: the branch a drafter is drafting (the arena's extra)
MIN_CONTEXT = 16  # the smallest context a session runs with (memory.max_context's lower limit)
CONTEXT_LIMIT = 1 << 20  # memory.max_context's upper limit: where max_context() stops looking
PREFILL_CHUNK = MemoryConfig.prefill_chunk  # the engine's prefill forwards (memory.prefill_chunk's default)
# How to plan or run past a model's max_position_embeddings (asked for by name: the model was not trained there)
EXCEED_KEY, EXCEED_FLAG = "memory.exceed_max_position_embeddings", "--exceed-max-position-embeddings"
# Bytes per weight; int4 carries an fp16 scale per group of 128 weights (AWQ / GPTQ layout), int8 a per-row scale.
# llama.cpp's quants (ggml block layouts): q8_0 34 B per 32 weights, q6_K 210 B per 256, and q4_K_M, a mix of
# q4_K (144 B per 256) with q6_K for attn_v / ffn_down in half the layers: ~4.8 bits per decoder-layer weight
# (Llama-3-8B Q4_K_M, 4.92 GB, less its q6_K output and q4_K token_embd); its LM head is q6_K.
# A bundle's own files override these by their sizes on disk (bundle_inputs).
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5 + 2 / 128,
                    "q8_0": 34 / 32, "q6_K": 210 / 256, "q4_K_M": 4.8 / 8}
PRECISIONS = ("fp32", "fp16", "int8", "int4", "q8_0", "q4_K_M")  # --precision choices (q6_K: heads only)
HEAD_OF_QUANT = {"q4_K_M": "q6_K"}  # llama.cpp keeps the LM head (or a tied embedding) at q6_K in q4_K_M
# Resident bytes of the process before any model is loaded (VmRSS after imports, measured on the dev VM);
# "device": a CUDA context + cuBLAS/TensorRT workspace on Orin, an estimate until profiled there. A bundle
# profiled with `edgespec memory profile --save` stores its own per backend/precision (bundle_overhead).
RUNTIME_OVERHEAD = {"numpy_ref": 40 * MiB, "onnx": 76 * MiB, "gguf": 76 * MiB, "device": 512 * MiB,
                    "tensorrt": 512 * MiB}
# onnxruntime's CPU arena keeps each session's peak (target and draft graph alike), at ~2.4x the numpy
# activations of the same forward (zoo and stand-in, fp32/int8/int4 graphs, prefill of 480-2016 tokens: the
# peak within +5.3 % / -7.3 % of the plan; 2.5 over-planned the stand-in's int8 graph at 2048 by 10.8 %).
ONNX_SCRATCH_FACTOR = 2.4
GGUF_BATCH = 512  # llama.cpp's batch (runtime/backends/llamacpp.py max_batch): prefill in chunks of it
GGML_KV_PAD = 256  # llama.cpp attends over the used KV cells rounded up to 256 (llama_kv_cache::get_n_kv)
HEADROOM = 0.05  # share of the budget kept free (allocator fragmentation, the robot stack's spikes)
EAGLE3_DRAFT_VOCAB = 32000  # the draft vocabulary of the published EAGLE-3 heads


@dataclass(frozen=True)
class ModelDims:
    """The shapes that cost memory. A drafter that reads the target's embedding has own_embedding False;
    head_rows is its own LM head's rows (EAGLE-3: draft_vocab_size; 0 = it uses the target's head)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    own_embedding: bool = True
    head_rows: Optional[int] = None  # None = vocab
    attn_in: int = 0  # width into q/k/v; EAGLE-3 attends over [embedding; hidden] = 2H; 0 = hidden
    fusion_in: int = 0  # EAGLE-3's fc: three target hiddens (3H) -> H; 0 = none
    max_positions: int = 0  # max_position_embeddings: the context the model was trained for; 0 = unknown

    def layer_params(self) -> int:
        """Weights of one decoder layer. Llama-3.2-3B (H 3072, 24 heads, 8 KV, d 128, I 8192):
        q 3072x3072 + k,v 2x3072x1024 + o 3072x3072 + mlp 3x3072x8192 + 2 norms = 100,669,440."""
        h, a = self.hidden, self.attn_in or self.hidden
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = a * q + 2 * a * kv + q * h + 3 * h * self.intermediate + 2 * h
        n += (q + 2 * kv) if self.qkv_bias else 0
        n += 2 * self.head_dim if self.qk_norm else 0
        n += h if self.attn_in else 0  # EAGLE-3 normalises the hidden half separately
        return n

    def body_params(self) -> int:
        """Every weight but the embedding and the LM head: layers, final norm, fusion."""
        return self.layers * self.layer_params() + self.hidden + self.fusion_in * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden if self.own_embedding else 0

    def head_params(self) -> int:
        """The LM head's own weights; 0 when tied to the embedding (counted once, as the embedding)."""
        rows = self.vocab if self.head_rows is None else self.head_rows
        return 0 if (self.tie and self.own_embedding and rows == self.vocab) else rows * self.hidden

    def cache_shape(self) -> CacheShape:
        return CacheShape(self.layers, self.kv_heads, self.head_dim)


def dims_from_spec(spec) -> ModelDims:
    """ModelDims of a bundle's ModelSpec (runtime.model.spec)."""
    return ModelDims(spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                     spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings, spec.qkv_bias, spec.qk_norm,
                     max_positions=int(spec.max_position_embeddings))


def dims_from_hf_config(cfg: Dict, source: str = "config.json") -> ModelDims:
    """ModelDims of an HF config.json (Llama, Qwen2/3, and EAGLE-3 heads: `draft_vocab_size` or an
    architecture naming Eagle3). An EAGLE-3 head reads the target's embedding, attends over 2H and fuses
    three target hiddens (fc 3H -> H); its LM head has draft_vocab_size rows."""
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        eagle3 = "draft_vocab_size" in cfg or any("eagle3" in a.lower() for a in cfg.get("architectures") or [])
        return ModelDims(
            hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            tie=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=cfg.get("model_type") == "qwen3" and not eagle3,
            own_embedding=not eagle3,
            head_rows=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) if eagle3 else None,
            attn_in=2 * hidden if eagle3 else 0, fusion_in=3 * hidden if eagle3 else 0,
            max_positions=int(cfg.get("max_position_embeddings") or 0))
    except KeyError as exc:
        raise ConfigError(f"{source}: missing key {exc.args[0]!r}; an HF config.json of a Llama/Qwen model "
                          "(or an EAGLE-3 head) has it") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: a dimension is not an integer ({exc})") from None


def read_hf_config(path: str) -> ModelDims:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror}); give the path of an HF config.json") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object (an HF config.json)")
    return dims_from_hf_config(cfg, path)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on except the context and the budget."""
    target: ModelDims
    drafter: Optional[ModelDims] = None
    precision: str = "fp16"  # decoder-layer weights of target and drafter
    head_precision: str = "fp16"  # embedding and LM heads (kept at fp16 by int4 runtimes)
    drafter_precision: Optional[str] = None  # every drafter weight, where it differs (a numpy draft: fp32)
    kv_bytes: int = 2  # bytes per K/V element
    drafter_extra_bytes: int = 0  # weights a drafter holds beyond its dims (e.g. an MTP module, measured)
    drafter_kstep_bytes: int = 0  # its K-step graph's own session (DrafterMemory.kstep_bytes), when it runs one
    tree_tokens: int = 5  # tokens in the largest verify forward (draft depth x branching + the root)
    prefill_tokens: Optional[int] = None  # tokens per target prefill forward (memory.prefill_chunk); None = one forward
    drafter_prefill_tokens: Optional[int] = None  # tokens per forward of the drafter's own catch-up; None = one
    exceed_max_positions: bool = False  # plan past target.max_positions (EXCEED_KEY, asked for by name)
    overhead_bytes: int = RUNTIME_OVERHEAD["device"]
    overhead_note: str = "interpreter, libraries (default estimate)"
    target_file_bytes: Optional[int] = None  # the target's weight files as the backend loads them (None: from dims)
    scratch_factor: float = 1.0  # backend activations / the numpy float32 count (ONNX_SCRATCH_FACTOR for onnx)
    fused_attention: bool = False  # device runtimes (TensorRT, llama.cpp) never hold the attention scores
    ggml: bool = False  # llama.cpp's CPU buffers instead of the numpy count (ggml_scratch_bytes), per model
    drafter_scratch: bool = False  # the drafter's own forward keeps its scratch too (a separate ORT session)
    chunk_outputs: bool = False  # the prefill returns every prompt row's logits as batches, then their concatenation
    headroom: float = HEADROOM


@dataclass(frozen=True)
class DrafterMemory:
    """What one drafter adds to the plan, as its kind declares it (runtime/drafters/<name>.py SPEC.memory)."""
    dims: Optional[ModelDims] = None  # decoder layers of its own (their weights and their KV cache rows)
    precision: Optional[str] = None  # of those layers' weights
    extra_bytes: int = 0  # weights beyond `dims` (heads, codebooks, a copy of the target's embedding)
    # its own forward over a new prompt runs in the engine's prefill chunks (Drafter.prefill_chunk: the draft model,
    # EAGLE); False: in one forward (DFlash runs its context rows with its first block)
    prefill_chunked: bool = False
    # A K-step graph (a chain in one ONNX Runtime run) is a second session beside the step graph's, holding its
    # weights again: its files' bytes (shared.kstep_memory), counted when `kstep_mode` runs it on the backend
    kstep_bytes: int = 0
    kstep_mode: str = "off"
    # the graph drafts one chain: a session drafting `branching` > 1 chains never opens it (draft model, EAGLE)
    kstep_chain_only: bool = False


NO_DRAFTER = DrafterMemory()


@dataclass(frozen=True)
class Row:
    name: str
    bytes: int
    note: str = ""


def weight_bytes(dims: ModelDims, precision: str, head_precision: str) -> Tuple[int, int]:
    """(decoder-layer bytes, embedding + head bytes). Qwen3-1.7B at int4 with an fp16 tied head:
    body 1,409,410,048 params -> 726,727,056 B, and 151936 x 2048 x 2 = 622,329,856 B for the head."""
    body = math.ceil(dims.body_params() * BYTES_PER_WEIGHT[precision])
    return body, math.ceil((dims.embedding_params() + dims.head_params()) * BYTES_PER_WEIGHT[head_precision])


def target_weight_bytes(inp: "PlanInputs") -> Tuple[int, int]:
    """(decoder-layer bytes, embedding + head bytes) of the target: from its dims at the plan's precisions, or,
    when the backend loads its files as they are (ONNX graphs, GGUF), their size on disk with the head's share
    from the dims. The zoo's int4 ONNX graph: 364,957 + 7,095,296 B of files, 3,145,728 of them the float32 tied
    embedding/head (3072 x 256 x 4), 4,314,525 the decoder layers."""
    body, head = weight_bytes(inp.target, inp.precision, inp.head_precision)
    if inp.target_file_bytes is None:
        return body, head
    head = min(head, inp.target_file_bytes)
    return inp.target_file_bytes - head, head


def drafter_weight_bytes(inp: "PlanInputs") -> Tuple[int, int]:
    if inp.drafter is None:
        return 0, 0
    if inp.drafter_precision is not None:
        return weight_bytes(inp.drafter, inp.drafter_precision, inp.drafter_precision)
    return weight_bytes(inp.drafter, inp.precision, inp.head_precision)


def kv_bytes_per_position(shapes: Sequence[CacheShape], kv_bytes: int) -> int:
    """K + V bytes one position costs in every cache. Qwen3-8B (36 layers, 8 KV heads, d 128) at fp16:
    2 x 36 x 8 x 128 x 2 = 147,456 B (144 KiB) per position."""
    return 2 * sum(s.num_layers * s.num_kv_heads * s.head_dim for s in shapes) * kv_bytes


def forward_scratch_bytes(dims: ModelDims, tokens: int, context: int, fused_attention: bool = False) -> int:
    """float32 activations alive at the peak of one forward of `tokens` new rows over `context` rows: four
    T x H residual-stream temporaries, plus the largest of the attention (scores and probabilities,
    2 x heads x T x S, and the T x S mask), the MLP (gate, up, product: 3 x T x I) and the logits (T x vocab).
    Zoo target, a 5-token verify at context 64: 4 x (4x5x256 + max(2x8x5x64 + 5x64/4, 3x5x768, 5x3072))
    = 4 x (5120 + 15360) = 81,920 B. A fused (flash) attention kernel, as device runtimes use, keeps no scores."""
    t, s = tokens, context
    attention = 0 if fused_attention else 2 * dims.heads * t * s + t * s // 4
    return 4 * (4 * t * dims.hidden + max(attention, 3 * t * dims.intermediate, t * dims.vocab))


def ggml_scratch_bytes(dims: ModelDims, tokens: int, context: int) -> int:
    """What one llama.cpp context (flash attention off, the CPU backend) keeps resident after a forward of
    `tokens` rows with the cache filled to `context`; it attends over n_kv = context rounded up to GGML_KV_PAD:
      compute buffer  float32: the scores (heads x T x n_kv; the softmax runs in place), the f32 mask (T x n_kv)
                      and six T x H tensors, or the MLP (3 x T x I) or the logits (T x vocab) where larger
      work buffer     ggml-cpu converts the probabilities to f16 for their product with the f16 V cache
                      (2 x heads x T x n_kv B); it grows to its largest use and stays
      output buffer   the batch's float32 logits (T x vocab), also kept
    Both buffers are malloc'd, so only what the forwards touched is resident: the planned n_kv is the context's,
    not the n_ctx llama.cpp reserves (its logged compute buffer at n_kv = n_ctx is the same formula: 159.51 MiB
    for the stand-in target at 2304, 43.51 for the zoo target, 33.76 for the zoo draft model).
    Stand-in target (H 1024, 32 heads, I 4096, vocab 3072), 512 tokens at context 2048:
    4 x (6x512x1024 + 32x512x2048 + 512x2048) + 2 x 32x512x2048 + 4 x 512x3072
    = 150,994,944 + 67,108,864 + 6,291,456 = 224,395,264 B (214 MiB)."""
    t, n_kv = tokens, -(-context // GGML_KV_PAD) * GGML_KV_PAD
    attention = dims.heads * t * n_kv + t * n_kv
    compute = 4 * (6 * t * dims.hidden + max(attention, 3 * t * dims.intermediate, t * dims.vocab))
    return compute + 2 * dims.heads * t * n_kv + 4 * t * dims.vocab


def scratch_dims(dims: ModelDims) -> ModelDims:
    """`dims` with vocab = the rows its forward's logits have: its own head's (EAGLE-3: draft_vocab_size, 32000
    beside a 151936-token target), the vocabulary where it has none (head_rows 0: it uses the target's head)."""
    return replace(dims, vocab=dims.head_rows) if dims.head_rows else dims


def plan_rows(inp: PlanInputs, context: int, budget: int) -> List[Row]:
    """The rows of the plan at `context` positions (headroom: inp.headroom x budget)."""
    t_body, t_head = target_weight_bytes(inp)
    files = ", file sizes" if inp.target_file_bytes is not None else ""
    rows = [Row("target weights", t_body, f"{inp.target.layers} layers, {inp.precision}{files}"),
            Row("target embedding + head", t_head, ("tied, " if inp.target.tie else "") + inp.head_precision)]
    shapes = [inp.target.cache_shape()]
    if inp.drafter is not None or inp.drafter_extra_bytes:
        d_body, d_head = drafter_weight_bytes(inp)
        note = "shares the target's embedding" if inp.drafter and not inp.drafter.own_embedding else ""
        rows.append(Row("drafter weights", d_body + d_head + inp.drafter_extra_bytes, note))
    if inp.drafter_kstep_bytes:
        rows.append(Row("drafter K-step graph", inp.drafter_kstep_bytes,
                        "a second ONNX Runtime session holding the drafter's weights again (its files)"))
    positions = context + DRAFT_SLACK
    rows.append(Row("target KV", kv_bytes_per_position(shapes, inp.kv_bytes) * positions,
                    f"{positions} positions x {kv_bytes_per_position(shapes, inp.kv_bytes)} B"))
    if inp.drafter is not None:
        per = kv_bytes_per_position([inp.drafter.cache_shape()], inp.kv_bytes)
        rows.append(Row("drafter KV", per * positions, f"{positions} positions x {per} B"))
    prefill = min(context, inp.prefill_tokens or context)
    fused = inp.fused_attention
    if inp.ggml:
        def one(dims, tokens):
            return ggml_scratch_bytes(dims, tokens, context)
    else:
        def one(dims, tokens):
            return forward_scratch_bytes(dims, tokens, context, fused)
    scratch = int(max(one(inp.target, prefill), one(inp.target, inp.tree_tokens)) * inp.scratch_factor)
    what = f"prefill of {prefill} tokens" if prefill == context else f"a prefill chunk of {prefill} tokens"
    rows.append(Row("forward scratch", scratch, f"{what} or a {inp.tree_tokens}-token verify"))
    if inp.drafter is not None and inp.drafter_scratch:
        # The drafter's own graph session keeps its peak too: its catch-up over the prompt (the forward it runs
        # after the prefill), with logits over ITS head's rows (EAGLE-3: the draft vocabulary).
        d_prefill = min(context, inp.drafter_prefill_tokens or context)
        rows.append(Row("drafter scratch", int(one(scratch_dims(inp.drafter), d_prefill) * inp.scratch_factor),
                        f"its forward over {'a chunk of ' if d_prefill < context else ''}{d_prefill} prompt tokens"))
    if inp.chunk_outputs:
        # llama.cpp's forward (runtime/backends/llamacpp.py) copies each batch's float32 logits out, then
        # concatenates them (a copy even of one batch): two copies of a prefill chunk x vocab
        rows.append(Row("prefill logits", 2 * 4 * prefill * inp.target.vocab, f"2 x {prefill} x {inp.target.vocab} float32"))
    rows.append(Row("runtime overhead", inp.overhead_bytes, inp.overhead_note))
    rows.append(Row("headroom", int(inp.headroom * budget), f"{inp.headroom:.0%} of the budget"))
    return rows


def total_bytes(inp: PlanInputs, context: int, budget: int) -> int:
    return sum(r.bytes for r in plan_rows(inp, context, budget))


def context_limit(inp: PlanInputs) -> int:
    """The longest context a plan offers: the target's max_position_embeddings (past it the model was never
    trained, and rope positions it never saw give garbage, not an error), unless exceed_max_positions asks for more
    by name; CONTEXT_LIMIT where the dims do not say."""
    m = inp.target.max_positions
    return m if m and not inp.exceed_max_positions else CONTEXT_LIMIT


def limit_note(inp: PlanInputs) -> str:
    return (f"capped at the model's max_position_embeddings {inp.target.max_positions}; set {EXCEED_KEY}: true "
            f"({EXCEED_FLAG}) to override")


def check_context(inp: PlanInputs, context: int, what: str) -> None:
    """A ConfigError naming `what` (the flag / key), the value, the model's limit and the override, for a context
    past max_position_embeddings that was not asked for by name."""
    limit = context_limit(inp)
    if context > limit:
        raise ConfigError(f"{what} {context}: above the model's max_position_embeddings {limit}, the longest context "
                          f"it was trained for; give at most {limit}, or set {EXCEED_KEY}: true ({EXCEED_FLAG}) to "
                          "run past it")


def max_context(inp: PlanInputs, budget: int, limit: Optional[int] = None) -> int:
    """The longest context (positions, <= limit, default context_limit(inp)) whose plan fits in `budget`; 0 if not
    even one position does. total() grows with the context, so a bisection finds the boundary exactly."""
    limit = context_limit(inp) if limit is None else limit
    if total_bytes(inp, 1, budget) > budget:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total_bytes(inp, mid, budget) <= budget else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class Plan:
    rows: Tuple[Row, ...]
    budget: int
    context: int  # the context the rows are for
    max_context: int
    capped_at: Optional[int] = None  # max_context was cut to the model's max_position_embeddings (the budget holds more)

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def row(self, name: str) -> int:
        return sum(r.bytes for r in self.rows if r.name == name)

    def to_dict(self) -> Dict:
        return {"budget_bytes": self.budget, "context": self.context, "max_context": self.max_context,
                "max_context_capped_at": self.capped_at,
                "total_bytes": self.total, "fits": self.fits,
                "rows": [{"name": r.name, "bytes": r.bytes, "share": r.bytes / self.budget if self.budget else None,
                          "note": r.note} for r in self.rows]}


def make_plan(inp: PlanInputs, budget: int, context: Optional[int] = None) -> Plan:
    """The plan at `context` (default: the longest context the budget holds, or MIN_CONTEXT if none)."""
    best = max_context(inp, budget)
    limit = context_limit(inp)
    capped = best == limit < CONTEXT_LIMIT and total_bytes(inp, limit + 1, budget) <= budget
    ctx = context if context is not None else max(best, MIN_CONTEXT)
    return Plan(tuple(plan_rows(inp, ctx, budget)), budget, ctx, best, limit if capped else None)


def budget_needed(inp: PlanInputs, context: int) -> int:
    """The smallest budget holding `context` positions: the fixed rows plus the headroom share of the budget
    itself, B = rest / (1 - headroom)."""
    rest = sum(r.bytes for r in plan_rows(inp, context, 0) if r.name != "headroom")
    return math.ceil(rest / (1.0 - inp.headroom))


def over_budget(inp: PlanInputs, budget: int, context: int, what: str) -> str:
    """The message of a BudgetExceeded: the budget, what it was asked to hold, each row, and the budget that
    would hold it."""
    rows = plan_rows(inp, context, budget)
    parts = ", ".join(f"{r.name} {r.bytes / MiB:.1f}" for r in rows)
    return (f"memory budget {budget / MiB:.1f} MiB cannot hold {what} at {context} positions: the plan needs "
            f"{sum(r.bytes for r in rows) / MiB:.1f} MiB ({parts} MiB). Raise memory.budget_mb to at least "
            f"{math.ceil(budget_needed(inp, context) / MiB)}, shorten the request or pick a smaller drafter; "
            "`edgespec memory plan --bundle DIR` shows the plan")


def smaller_chunk(prefill: int) -> int:
    """The prefill chunk a lever proposes: a quarter of today's, as a power of two, at least 16 tokens
    (512 -> 128; a whole 1073-token prompt -> 256)."""
    return max(16, 1 << max(0, (prefill // 4).bit_length() - 1))


def levers(inp: PlanInputs, budget: int, context: int) -> List[Dict]:
    """What each change would free at `context`, largest first, and the rows it shrinks: quantizing the target's
    layers (int8, int4), its embedding/head, dropping the drafter, a 32k draft vocabulary, fp16 KV, a smaller
    prefill chunk (memory.prefill_chunk: the forward scratch of a long prompt)."""
    options = []
    rank = {"fp32": 0, "fp16": 1, "int8": 2, "q8_0": 2, "q6_K": 2.5, "int4": 3, "q4_K_M": 3}
    for p in ("int8", "int4"):  # from the dims: the alternative has no files yet
        if rank[p] > rank[inp.precision]:
            options.append((f"{p} decoder-layer weights", replace(inp, precision=p, target_file_bytes=None)))
    if rank[inp.head_precision] < rank["int8"]:
        options.append(("int8 embedding and LM heads", replace(inp, head_precision="int8", target_file_bytes=None)))
    if inp.drafter is not None or inp.drafter_extra_bytes:
        options.append(("no drafter (plain decoding)", replace(inp, drafter=None, drafter_extra_bytes=0,
                                                                drafter_kstep_bytes=0)))
    d = inp.drafter
    if d is not None and (d.head_rows if d.head_rows is not None else d.vocab) > EAGLE3_DRAFT_VOCAB:
        options.append((f"a {EAGLE3_DRAFT_VOCAB // 1000}k draft vocabulary",
                        replace(inp, drafter=replace(d, head_rows=EAGLE3_DRAFT_VOCAB))))
    if inp.kv_bytes > 2:
        options.append(("fp16 KV cache", replace(inp, kv_bytes=2)))
    prefill = min(context, inp.prefill_tokens or context)
    if prefill > 16:
        n = smaller_chunk(prefill)
        options.append((f"memory.prefill_chunk {n} (prefill forwards of {n} tokens, not {prefill})",
                        replace(inp, prefill_tokens=n, drafter_prefill_tokens=inp.drafter_prefill_tokens and
                                min(n, inp.drafter_prefill_tokens))))
    now = {r.name: r.bytes for r in plan_rows(inp, context, budget)}
    out = []
    for name, alt in options:
        then = {r.name: r.bytes for r in plan_rows(alt, context, budget)}
        freed = {row: b - then.get(row, 0) for row, b in now.items() if b > then.get(row, 0)}
        out.append({"lever": name, "frees_bytes": sum(now.values()) - sum(then.values()),
                    "rows": sorted(freed, key=lambda r: -freed[r]), "max_context": max_context(alt, budget)})
    return sorted(out, key=lambda x: -x["frees_bytes"])


def projected_decode(inp: PlanInputs, context: int, bandwidth_gbs: float, tau: Optional[float] = None,
                     num_draft: int = 4) -> Dict:
    """The bandwidth bound of batch-1 decoding (a projection, not a measurement): each token reads the
    target's layers and LM head (the embedding only one row) and the KV of `context` positions.
    Speculative, with a measured tau: a cycle reads the target once and the drafter `num_draft` times.
    Qwen3-1.7B int4 at 68 GB/s, short context: 68e9 / 1.35e9 B = ~50 tok/s at most."""
    t_body, _ = target_weight_bytes(inp)
    head = inp.target.vocab * inp.target.hidden * BYTES_PER_WEIGHT[inp.head_precision]
    kv = kv_bytes_per_position([inp.target.cache_shape()], inp.kv_bytes) * context
    per_token = t_body + head + kv
    out = {"bytes_per_token": int(per_token), "lm_head_share": head / per_token,
           "plain_tok_s_bound": bandwidth_gbs * 1e9 / per_token}
    if tau is not None:
        d_read = sum(drafter_weight_bytes(inp)) + inp.drafter_extra_bytes
        out["speculative_tok_s_bound"] = tau * bandwidth_gbs * 1e9 / (per_token + num_draft * d_read)
    return out
