"""The target's own MTP modules (DeepSeek-V3 layout and two others) as a drafter.

Module i (0-based) at position t, reading the previous module's output (the target's last layer for i = 0):

    h^i'_t  = proj(concat[emb_norm(emb(x_{t+1+i})), hidden_norm(h^{i-1}_t)])    embedding first; h^{-1} = target
    h^i_t   = decoder_layer_i(h^i'_t) at rotary position t                     output BEFORE the out norm
    q(x_{t+2+i}) = head(out_norm(h^i_t))                                        head and embedding are the target's

Draft depth j uses module j (k modules, k tokens); asked for more tokens than it has modules, the drafter
reuses the last module autoregressively on its own output h at the next position, as MTP runtimes do.

Each module has its own one-layer KV cache (in the shared arena). Row t of module i holds (h^{i-1}_t, x_{t+1+i}),
so with n committed tokens module i has rows t <= n-2-i committed; drafting writes its rows n-1-i .. n-2 (they
read drafted tokens) as temporary rows, dropped at `accept` like the autoregressive ones. Example, k = 2,
committed x_0..x_9 (n = 10), the root x_9 not yet run by the target:
    module 0 runs rows ..8 (h_8, x_9)                        -> draft d1 = x_10
    module 1 runs rows ..7 (h^0_7, x_9) committed, row 8 (h^0_8, d1) temporary -> d2 = x_11
    module 1 again at position 9 on (h^1_8, d2)                -> d3 (autoregressive reuse)

A module runs in numpy (the oracle) or, when the bundle has its graph and the session runs on ONNX Runtime,
as that graph (export/drafters/mtp_onnx.py: hidden + next tokens + its own past K/V -> logits of the last
row, output hidden, new K/V rows), both through the one head runner (runtime/drafters/heads.py).

Three checkpoint layouts name the modules (`MTP_LAYOUTS`; the decoder layer keys follow the target family):
  deepseek_v3  model.layers.{N+i}.{enorm, hnorm, eh_proj, shared_head.norm, [shared_head.head]}  concat [emb, hidden]
  qwen3_next   mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}, layer at mtp.layers.{i}  concat [emb, hidden]
  mimo         model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm} concat [hidden, emb]"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from runtime.backends.factory import load_weights
from runtime.drafters.base import DraftContext, Drafter, DrafterBuild, DrafterSpec, draft_cache_shapes
from runtime.drafters.heads import HeadRunner, head_graphs, head_kstep
from runtime.drafters.shared import (KSTEP, STEPWISE, kstep_chain, kstep_fits, kstep_memory, kstep_mode,
                                     kstep_uniforms, node_confidence, pick)
from runtime.errors import BundleError
from runtime.memory.kv import CacheShape, KVCache
from runtime.memory.bundle_sizes import entry_numel, target_embedding_copy_bytes
from runtime.memory.plan import DrafterMemory
from runtime.model.layers import (causal_mask, decoder_layer, decoder_layer_weight_names, rms_norm, rope_cos_sin,
                            rope_inv_freq)
from runtime.model.spec import ModelSpec
from runtime.sampling import process_logits
from runtime.tree import DraftTree, empty_tree

# The graph of one module (export/drafters/mtp_onnx.py); T new rows, P past rows of the module's own cache.
GRAPH_INPUTS = ("hidden",  # float32 (T, H): the previous module's (or the target's) output h_t
                "input_ids",  # int64 (T,): x_{t+1+i}
                "position_ids",  # int64 (T,)
                "attention_mask",  # float32 (T, P+T) additive
                "past_key", "past_value")  # kv (P, nkv, d)
GRAPH_OUTPUTS = ("logits",  # float32 (1, V): the last row's
                 "hidden_out",  # float32 (T, H): this module's output h^i_t (before its out norm)
                 "new_key", "new_value")  # kv (T, nkv, d)


def mtp_cache_shape(spec: ModelSpec) -> CacheShape:
    """One module's cache: one layer of the target's shape."""
    return CacheShape(1, spec.num_kv_heads, spec.head_dim)


@dataclass(frozen=True)
class MTPLayout:
    """Where module i's tensors live in a checkpoint ({n}: the module's layer index N+i for DeepSeek-V3, its
    index i for the others; `prefix` without {n} = tensors shared by all modules)."""
    prefix: str  # of the module's own tensors
    layer: str  # of its decoder layer
    emb_norm: str
    hidden_norm: str
    proj: str  # (H, 2H): the fused input's projection
    out_norm: str  # before the (shared) head
    head: Optional[str]  # the module's own head, if the layout may carry one
    hidden_first: bool  # concat order: [hidden, emb] (MiMo) instead of [emb, hidden]
    numbered_by_layer: bool  # {n} counts target layers (DeepSeek-V3), not modules

    def names(self, n: int) -> Dict[str, str]:
        p, lp = self.prefix.format(n=n), self.layer.format(n=n)
        out = {"emb_norm": p + self.emb_norm, "hidden_norm": p + self.hidden_norm, "proj": p + self.proj,
               "out_norm": p + self.out_norm, "layer": lp}
        if self.head:
            out["head"] = p + self.head
        return out


MTP_LAYOUTS = {
    "deepseek_v3": MTPLayout("model.layers.{n}.", "model.layers.{n}.", "enorm.weight", "hnorm.weight",
                             "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight", False, True),
    "qwen3_next": MTPLayout("mtp.", "mtp.layers.{n}.", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                            "fc.weight", "norm.weight", None, False, False),
    "mimo": MTPLayout("model.mtp_layers.{n}.", "model.mtp_layers.{n}.", "token_layernorm.weight",
                      "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight", None, True, False),
}


def module_keys(layout: str, index: int, first_layer_index: int) -> Dict[str, str]:
    """The checkpoint keys of module `index` (0-based) in `layout`."""
    if layout not in MTP_LAYOUTS:
        raise BundleError(f"MTP module: layout {layout!r} unknown; expected one of {sorted(MTP_LAYOUTS)}")
    lay = MTP_LAYOUTS[layout]
    return lay.names(first_layer_index + index if lay.numbered_by_layer else index)


class MTPModule:
    """One module's weights, its KV cache rows and (optionally) its ONNX graph."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], keys: Dict[str, str], layout: str,
                 cache: KVCache, embed: np.ndarray, head: np.ndarray, net=None):
        p = keys["layer"]
        own = [keys[k] for k in ("emb_norm", "hidden_norm", "proj", "out_norm")]
        missing = [k for k in own + decoder_layer_weight_names(p, spec) if k not in weights]
        if missing:
            raise BundleError(f"MTP module: missing weights {missing[:3]}; expected {layout} keys ({own[0]}, ...)")
        proj = np.asarray(weights[keys["proj"]])
        h = spec.hidden_size
        if proj.shape != (h, 2 * h):
            raise BundleError(f"MTP module: {keys['proj']} has shape {proj.shape}, expected ({h}, {2 * h})")
        if MTP_LAYOUTS[layout].hidden_first:  # store [emb, hidden] columns: one concat order below
            proj = np.concatenate([proj[:, h:], proj[:, :h]], axis=1)
        self.prefix = p
        self.spec = spec
        self.embed = embed
        self.inv_freq = rope_inv_freq(spec)
        self.cache = cache
        self.head_runner = HeadRunner(cache, net, inputs=GRAPH_INPUTS, outputs=GRAPH_OUTPUTS)
        if net is not None:  # the graph holds the weights: no float32 copies kept beside it
            return
        self.w = {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in decoder_layer_weight_names(p, spec)}
        self.norms = {k: np.ascontiguousarray(weights[keys[k]], np.float32) for k in ("emb_norm", "hidden_norm", "out_norm")}
        self.proj = np.ascontiguousarray(proj, np.float32)  # (H, 2H), columns [emb, hidden]
        own_head = weights.get(keys.get("head", ""))
        self.head = np.ascontiguousarray(own_head, np.float32) if own_head is not None else head

    @property
    def net(self):
        return self.head_runner.net

    @property
    def weight_bytes(self) -> int:
        if self.net is not None:
            return self.head_runner.weight_bytes
        return sum(a.nbytes for a in self.w.values()) + self.proj.nbytes + sum(a.nbytes for a in self.norms.values())

    def run(self, hidden: np.ndarray, next_tokens: Sequence[int], start_pos: int):
        """Rows at positions start_pos.. appended to the cache -> (output hidden (T, H), logits of the last row (V,))."""
        return self.head_runner.run(hidden.shape[0], lambda start: self._run_numpy(hidden, next_tokens, start_pos, start),
                                    lambda start: self._graph_feeds(hidden, next_tokens, start_pos, start),
                                    lambda got: (got["hidden_out"], got["logits"][-1]))

    def _run_numpy(self, hidden, next_tokens, start_pos, start):
        spec, norms = self.spec, self.norms
        e = rms_norm(self.embed[np.asarray(next_tokens)], norms["emb_norm"], spec.rms_norm_eps)
        h = rms_norm(hidden, norms["hidden_norm"], spec.rms_norm_eps)
        x = np.concatenate([e, h], axis=-1) @ self.proj.T  # (T, H)
        t = x.shape[0]
        cos, sin = rope_cos_sin(self.inv_freq, np.arange(start_pos, start_pos + t))
        out = decoder_layer(self.w, self.prefix, spec, x, cos, sin, self.cache.k[:, 0], self.cache.v[:, 0], start,
                            causal_mask(start, t))
        return out, rms_norm(out[-1], norms["out_norm"], spec.rms_norm_eps) @ self.head.T

    @staticmethod
    def _graph_feeds(hidden, next_tokens, start_pos: int, start: int) -> Dict[str, np.ndarray]:
        t = hidden.shape[0]
        mask = np.zeros((t, start + t), np.float32)  # causal over the new rows, all of the past
        if t > 1:
            mask[:, start:][np.triu_indices(t, 1)] = -np.inf
        return {"hidden": np.asarray(hidden, np.float32), "input_ids": np.asarray(next_tokens, np.int64),
                "position_ids": np.arange(start_pos, start_pos + t, dtype=np.int64), "attention_mask": mask}


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray], embed: np.ndarray, head: np.ndarray,
                 caches: Sequence[KVCache], num_tokens: int = 2, layer_index: Optional[int] = None,
                 layout: str = "deepseek_v3", nets: Optional[Sequence] = None, kstep=None):
        """caches: one per module (len = the number of modules); nets: one ONNX graph (OnnxNet) per module, or None;
        kstep: a single module's K-step chain graph (runtime/drafters/heads.HeadKStep), or None."""
        if isinstance(caches, KVCache):
            caches = [caches]
        first = spec.num_layers if layer_index is None else layer_index
        if nets is not None and len(nets) != len(caches):
            raise BundleError(f"MTP: {len(nets)} module graphs for {len(caches)} modules; re-export the ONNX graphs")
        self.modules = [MTPModule(spec, weights, module_keys(layout, i, first), layout, c, embed, head,
                                  None if nets is None else nets[i]) for i, c in enumerate(caches)]
        self.layout = layout
        self.spec = spec
        self.k = num_tokens
        self.target_taps = (f"layer_out.{spec.num_layers - 1}",)
        self.rows = [0] * len(self.modules)  # committed cache rows of each module
        # per module: its input hiddens not yet run, from its first uncommitted row on (module 0: the target's)
        self.pending: List[List[np.ndarray]] = [[] for _ in self.modules]
        self._shared = 0  # n of the last `reusable_prefix` call
        self.kstep = kstep if len(self.modules) == 1 else None
        self._paths: Dict[str, int] = {KSTEP: 0, STEPWISE: 0}

    @property
    def draft_paths(self) -> Dict[str, int]:
        return dict(self._paths) if self.kstep is not None else {}

    @property
    def backend(self) -> str:
        return "onnx" if self.modules[0].net is not None else "numpy"

    @property
    def memory_bytes(self) -> int:
        return sum(m.weight_bytes for m in self.modules)

    @property
    def committed_rows(self) -> int:
        return self.rows[0]

    def reset(self) -> None:
        for m in self.modules:
            m.cache.reset()
        self.rows = [0] * len(self.modules)
        self.pending = [[] for _ in self.modules]

    def begin(self, prompt: Sequence[int], taps: Dict[str, np.ndarray], start: int = 0) -> None:
        new = list(taps[self.target_taps[0]])  # h_t for t = start .. len(prompt) - 1
        if not start:
            self.reset()
            self.pending[0] = new
            return
        plan = self.keep_plan(self._shared)  # the plan `reusable_prefix` answered with
        if plan[0] != start:
            raise RuntimeError(f"MTP: begin(start={start}) but reusable_prefix allowed {plan[0]}")
        for i, m in enumerate(self.modules):
            kept, source = plan[i + 1], plan[i]  # source: where module i's input rows are recomputed from
            m.cache.keep(kept, [])
            # inputs for rows kept .. source-1 come from pending (kept == rows[i] then), the rest are recomputed
            self.pending[i] = self.pending[i][:source - kept] if kept < source else []
            self.rows[i] = kept
        self.pending[0] += new

    def keep_plan(self, n: int) -> List[int]:
        """[start, m_0, .., m_{k-1}]: the target keeps `start` rows and module i its first m_i rows, when the new
        prompt shares its first n tokens with the tokens behind the caches. Module i's row t holds
        (h^{i-1}_t, x_{t+1+i}) and its input h^{i-1}_t reads x_0 .. x_{t+i}, so both stay valid for t <= n-2-i
        (rows) and t <= n-1-i (inputs). Module i recomputes its rows from m_i on, reading inputs that module i-1
        (the target for i = 0) recomputes from its own m_{i-1} (start) on; so m_i <= m_{i-1}, and where
        m_i < m_{i-1} its inputs for t in [m_i, m_{i-1}) must be ones it has not run yet (pending, from its
        committed rows on, i.e. m_i = its committed rows). Where they are not, m_{i-1} comes down to what they
        cover, and so on up to the target.

        Example, 2 modules after a request whose last cycle drafted after n0 = 10 tokens and committed 3: module 0
        holds rows 0..8 with h_9..h_11 pending (the target's), module 1 rows 0..7 with h^0_8 pending. A new prompt
        sharing n = 12 tokens: m_1 = 8, m_0 = 9, start = 12 (nothing recomputed). Had module 1 nothing pending,
        module 0 would keep only 8 rows to recompute h^0_8 for it, and then the target h_8 from start = 8 on.
        One module, rows 0..4 with h_5..h_9 pending, n = 12: m_0 = 5, start = 10 (the target reruns from 10)."""
        bound = [n] + [max(0, min(r, n - 1 - i)) for i, r in enumerate(self.rows)]
        while True:
            plan = [bound[0]]
            for b in bound[1:]:
                plan.append(min(b, plan[-1]))
            for i, r in enumerate(self.rows):
                kept, source = plan[i + 1], plan[i]
                if kept == source:
                    continue
                held = r + min(len(self.pending[i]), max(0, n - i - r)) if kept == r else kept
                if held < source:
                    bound[i] = held  # strictly lower than before: the loop ends
                    break
            else:
                return plan

    def reusable_prefix(self, n: int) -> int:
        """With n target rows shareable, how many to keep: `keep_plan`'s start (remembered for `begin`)."""
        self._shared = n
        return self.keep_plan(n)[0]

    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens = list(ctx.tokens)
        n = len(tokens)
        for m, r in zip(self.modules, self.rows):
            m.cache.keep(r, [])
        last = self.modules[-1].cache
        depth = min(self.k, ctx.max_nodes, last.max_positions - (n - 1) + len(self.modules))
        room = last.max_positions - (n - 1)  # rows past the catch-up (one module)
        if kstep_fits(ctx, self.kstep, 1, depth, len(self.pending[0]), room, self.prefill_chunk):
            return self._propose_kstep(ctx, tokens, depth)
        self._paths[STEPWISE] += 1
        drafted: List[int] = []
        qs = []
        temp: List[np.ndarray] = []  # the previous module's outputs at its temporary rows
        h_last = None
        stop, greedy = ctx.stop, ctx.params.greedy  # per-node early stopping (runtime/speculation.NodeRule)
        conf: List[float] = []  # path confidence per drafted node
        path = 1.0
        for j in range(depth):
            seq = tokens + drafted
            if j < len(self.modules):
                out, logits, temp = self._run_module(j, seq, temp, n)
                h_last = out[-1:]
            else:  # the last module again, on its own output at the next position (a temporary row)
                h_last, logits = self.modules[-1].run(h_last, [drafted[-1]], n - 2 + j - len(self.modules) + 1)
                h_last = h_last[-1:]
            m = ctx.mask(drafted)
            q = process_logits(logits, ctx.params, seq, m)
            if stop is not None and not greedy and not stop.pays(stop.drawn_gain(path, q, j + 1), j):
                break  # decided on q before the draw (exact)
            t = pick(q, ctx.params, ctx.rng)
            c = path * node_confidence(logits, q, t, ctx.params, seq, m) if ctx.wants_confidence else 1.0
            if stop is not None and greedy and not stop.pays(stop.fixed_gain(c), j):
                break
            drafted.append(t)
            qs.append(q)
            conf.append(c)
            path = c
        if not drafted:
            return empty_tree()
        return DraftTree(tokens=np.asarray(drafted, np.int64), parents=np.arange(-1, len(drafted) - 1, dtype=np.int64),
                         q=None if greedy else np.stack(qs), deterministic=np.full(len(drafted), greedy),
                         confidence=np.asarray(conf, np.float64) if ctx.wants_confidence else None)

    def _propose_kstep(self, ctx: DraftContext, tokens: List[int], depth: int) -> DraftTree:
        """The single module's chain from one run of its K-step graph: module 0's rows r .. n-2 (all committed) and
        K drafted tokens on its own output (`shared.kstep_chain` cuts it as the step-wise chain would be cut)."""
        n, r = len(tokens), self.rows[0]
        inputs = self.pending[0]
        if len(inputs) != n - 1 - r:
            raise RuntimeError(f"MTP module 0: {len(inputs)} input rows for positions {r}..{n - 2}")
        self._paths[KSTEP] += 1
        got = self.kstep.run(self.modules[0].cache, tokens[r + 1:n], np.stack(inputs), np.arange(r, n - 1), ctx.params,
                             tokens, kstep_uniforms(ctx, self.kstep.steps))
        self.rows[0], self.pending[0] = n - 1, []
        return kstep_chain(ctx, got.tokens, got.q, got.confidence, depth)

    def _run_module(self, i: int, seq: Sequence[int], temp: List[np.ndarray], n: int):
        """Module i over its rows r .. n-2 (r: its committed rows; seq = committed tokens + the i drafted):
        rows t <= n-2-i read committed tokens and stay, the rest are temporary. Its committed outputs become
        module i+1's pending inputs. -> (outputs (T, H), logits of row n-2, outputs of the temporary rows)."""
        r = self.rows[i]
        inputs = self.pending[i] + temp  # h^{i-1}_t for t = r .. n-2
        if len(inputs) != n - 1 - r:
            raise RuntimeError(f"MTP module {i}: {len(inputs)} input rows for positions {r}..{n - 2}")
        out, logits = self.modules[i].run(np.stack(inputs), seq[r + 1 + i:n + i], r)
        commit = max(0, n - 1 - i - r)
        if i + 1 < len(self.modules):
            self.pending[i + 1] += list(out[:commit])
        self.pending[i] = self.pending[i][commit:]
        self.rows[i] = r + commit
        return out, logits, list(out[commit:])

    def accept(self, accepted_nodes, committed, taps) -> None:
        for m, r in zip(self.modules, self.rows):
            m.cache.keep(r, [])  # drop the temporary rows of the chain
        # append: `propose` consumes pending, but a cycle that verified no tree (one token left) did not run
        # the modules over the previous cycle's rows, and those must not be lost
        self.pending[0].extend(taps[self.target_taps[0]])


# -- built from a bundle entry ------------------------------------------------------------------

@dataclass(frozen=True)
class MTPParams:
    """bundle.yaml drafters.<name>.params of the target's MTP modules."""
    num_modules: int = 1
    first_layer_index: Optional[int] = None  # of module 0 in the checkpoint (None: right after the target's layers)
    layout: str = "deepseek_v3"  # one of MTP_LAYOUTS
    kstep: str = "auto"  # a single module's chain in one run of its K-step graph: auto (GPU providers) | on | off

    @staticmethod
    def from_dict(d: Mapping, where: str) -> "MTPParams":
        first = d.get("first_layer_index")
        return MTPParams(int(d.get("num_modules", 1)), None if first is None else int(first),
                         str(d.get("layout", "deepseek_v3")), kstep_mode(d, where))


def mtp_graphs(b: DrafterBuild, modules: int):
    """The MTP modules' ONNX graphs (one per module, in order) when the session runs on ONNX Runtime and the
    bundle has them in the float precision of this session's KV arena; None = run the modules in numpy."""
    files = b.entry.backends.get("onnx") if b.backend.kind == "onnx" else None
    if files is None or (files.params.get("precision") == "fp16") != (b.arena.dtype == np.float16):
        return None  # (graphs of the other float precision than the arena, e.g. beside an int8 target: numpy)
    return head_graphs(b, "MTP module", count=modules, unit="modules")


def build(b: DrafterBuild, p: MTPParams) -> MTPDrafter:
    bundle, entry = b.bundle, b.entry
    weights = load_weights(bundle, entry.files)
    spec = bundle.target.spec
    embed, head = b.embed_and_head()
    caches = [b.arena.allocate(f"mtp.{i}", mtp_cache_shape(spec), b.max_positions + b.num_tokens)
              for i in range(p.num_modules)]
    nets = mtp_graphs(b, p.num_modules)
    kstep = head_kstep(b, p.kstep, "MTP K-step") if nets is not None and p.num_modules == 1 else None
    return MTPDrafter(spec, weights, embed, head, caches, num_tokens=b.num_tokens,
                      layer_index=spec.num_layers if p.first_layer_index is None else p.first_layer_index,
                      layout=p.layout, nets=nets, kstep=kstep)


def cache_shapes(entry, p: MTPParams, target_spec) -> Dict[str, CacheShape]:
    """One layer of the target's shape per module."""
    return {**draft_cache_shapes(entry, p, target_spec),
            "mtp": CacheShape(p.num_modules, target_spec.num_kv_heads, target_spec.head_dim)}


def memory(bundle, entry, p: MTPParams, backend: str) -> DrafterMemory:
    """float32 numpy modules (their size from the safetensors header); beside a graph target they keep their own
    float32 copy of the target's embedding."""
    extra = 4 * entry_numel(bundle, entry)
    if backend != "numpy_ref":
        extra += target_embedding_copy_bytes(bundle.target.spec)
    kstep = kstep_memory(bundle, entry, backend) if p.num_modules == 1 else 0  # a graph of one module's chain
    return DrafterMemory(extra_bytes=extra, kstep_bytes=kstep, kstep_mode=p.kstep)


SPEC = DrafterSpec(kinds=("mtp",), params=MTPParams.from_dict, build=build, memory=memory, cache_shapes=cache_shapes,
                   sources={"mtp": (None, "the target's own MTP module (DeepSeek-V3 keys model.layers.N); this target has none")})
