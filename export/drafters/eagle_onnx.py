"""An EAGLE head's draft step as an ONNX graph, checked against the numpy drafter (runtime/drafters/eagle.py).

Graph contract (bundle entry `drafters.<name>.backends.onnx`, run through runtime/backends/onnx_net.py):
  inputs   input_ids       int64   (T,)         x_{t+1} of each row
           features        float32 (T, H)       f_t: EAGLE-1 the target's final-normed state, EAGLE-3 the fc of
                                                the three fused taps (numpy, once per committed row); deeper
                                                draft rows feed the layer's own output h'
           position_ids    int64   (T,)
           attention_mask  float32 (T, P+T)     additive: 0 = may attend, -inf = may not
           past_key        float32 (P, nkv, d)  the drafter's own K/V rows (its one layer)
           past_value      float32 (P, nkv, d)
           logit_rows      int64   (R,)         the rows whose logits leave the graph: all T for a tree's
                                                frontier, the last alone for a catch-up (a new prompt, a probe
                                                after plain steps), whose other rows' (T-1, V') the head would
                                                otherwise compute and drop: ~40 % of a zoo head's work per row
  outputs  logits          float32 (R, V')      EAGLE-1: the target's vocabulary (its LM head);
                                                EAGLE-3: the draft vocabulary (the runtime places it by d2t)
           hidden          float32 (T, H)       h', the feature of the next draft position
           new_key         float32 (T, nkv, d)  only the new rows; the runtime writes them into its cache
           new_value       float32 (T, nkv, d)
The step is: EAGLE-1 fc over concat[embed, f] (+ bias), the layer without input norm, the target head;
EAGLE-3 concat[input_layernorm(embed), hidden_norm(f)] into the 2H attention, the MLP half, norm, lm_head."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Tuple

import numpy as np
import torch
from torch import nn

from export.library_logs import quiet_library
from export.onnx.graph import OPSET, DecoderGraph, rms_norm, rotate, save_program
from runtime.backends.onnx import additive_mask
from runtime.model.bundle import sha256_of
from runtime.backends.onnx_net import OnnxNet
from runtime.drafters.eagle import EagleDrafter
from runtime.errors import ExportError
from runtime.model.layers import causal_mask

INPUTS = ("input_ids", "features", "position_ids", "attention_mask", "past_key", "past_value", "logit_rows")
OUTPUTS = ("logits", "hidden", "new_key", "new_value")
TOLERANCE = 1e-4  # max |graph - numpy| / max(1, max |numpy|) over logits, hidden and the new K/V rows:
# relative, since a trained head's peaked logits (|logit| ~ 50) carry float32 rounding above 1e-4 absolute


class EagleStepGraph(nn.Module):
    """The draft layer of an EagleDrafter (its float32 weights, embedding and head) as a torch module."""

    def __init__(self, drafter: EagleDrafter):
        super().__init__()
        self.spec = drafter.spec
        self.kind = drafter.kind
        self.prefix = drafter.prefix
        self.norm_before_residual = drafter.norm_before_residual
        if self.spec.qk_norm:
            raise ExportError(f"{drafter.kind}: a draft layer with q/k norms has no ONNX export here; run it on numpy_ref")
        tensors: Dict[str, np.ndarray] = dict(drafter.w, embed=drafter.embed, head=drafter.head)
        self._names = {}
        for name, arr in tensors.items():
            attr = name.replace(".", "__")
            self.register_buffer(attr, torch.from_numpy(np.array(arr, np.float32)), persistent=False)
            self._names[name] = attr
        self.register_buffer("inv_freq", torch.from_numpy(drafter.inv_freq.astype(np.float32)), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, self._names[name])

    def has(self, name: str) -> bool:
        return name in self._names

    _attention = DecoderGraph._attention  # grouped-query attention over past + new rows (reads only self.spec)

    def forward(self, input_ids, features, position_ids, attention_mask, past_key, past_value, logit_rows=None,
                last_only: bool = False):
        """The step on T rows -> (logits of rows `logit_rows` (all T when None; the last alone with `last_only`,
        the K-step graph's catch-up), h' (T, H), new K, new V)."""
        s, p = self.spec, self.prefix
        t, nh, nkv, d, eps = input_ids.shape[0], s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        emb = self.w("embed")[input_ids]  # (T, H)
        if self.kind == "eagle":
            x = torch.cat([emb, features], dim=-1) @ self.w("fc.weight").t()  # (T, H): embedding first
            if self.has("fc.bias"):
                x = x + self.w("fc.bias")
            attn_in = x  # no input norm on EAGLE-1's layer
        else:
            hn = rms_norm(features, self.w(p + "hidden_norm.weight"), eps)
            attn_in = torch.cat([rms_norm(emb, self.w(p + "input_layernorm.weight"), eps), hn], dim=-1)  # (T, 2H)
            x = hn if self.norm_before_residual else features
        q = attn_in @ self.w(p + "self_attn.q_proj.weight").t()
        k = attn_in @ self.w(p + "self_attn.k_proj.weight").t()
        v = attn_in @ self.w(p + "self_attn.v_proj.weight").t()
        if s.qkv_bias:
            q, k, v = (y + self.w(p + f"self_attn.{n}_proj.bias") for y, n in zip((q, k, v), "qkv"))
        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]  # (T, d/2)
        rope = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # (T, 1, d)
        cos, sin = rope.cos(), rope.sin()
        q = rotate(q.reshape(t, nh, d), cos, sin)
        k = rotate(k.reshape(t, nkv, d), cos, sin)
        v = v.reshape(t, nkv, d)
        x = x + self._attention(q, k, v, past_key, past_value, attention_mask) @ self.w(p + "self_attn.o_proj.weight").t()
        h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), eps)
        gate = h @ self.w(p + "mlp.gate_proj.weight").t()
        x = x + (torch.nn.functional.silu(gate) * (h @ self.w(p + "mlp.up_proj.weight").t())) @ self.w(p + "mlp.down_proj.weight").t()
        out = x[-1:] if last_only else x
        if logit_rows is not None:
            out = out.index_select(0, logit_rows)  # rows first: the norm and the head run only on those
        if self.kind == "eagle3":
            out = rms_norm(out, self.w("norm.weight"), eps)
        return out @ self.w("head").t(), x, k, v


def export_eagle_onnx(drafter: EagleDrafter, out_path: str) -> str:
    """Write the drafter's step graph to `out_path` (+ `.data`); returns out_path."""
    module = EagleStepGraph(drafter).eval()
    s = drafter.spec
    t, p = 3, 5  # example sizes, both exported dynamic (torch.export specialises 0 and 1)
    kv = (p, s.num_kv_heads, s.head_dim)
    args = (torch.zeros(t, dtype=torch.int64), torch.zeros(t, s.hidden_size), torch.arange(p, p + t),
            torch.zeros(t, p + t), torch.zeros(kv), torch.zeros(kv), torch.arange(1, t))  # R = 2: not specialised
    T, P, S, R = torch.export.Dim("T"), torch.export.Dim("P"), torch.export.Dim("S"), torch.export.Dim("R")
    dynamic = {"input_ids": {0: T}, "features": {0: T}, "position_ids": {0: T}, "attention_mask": {0: T, 1: S},
               "past_key": {0: P}, "past_value": {0: P}, "logit_rows": {0: R}}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():  # torch.onnx's notes and warnings about itself (--verbose shows them)
        program = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, input_names=list(INPUTS),
                                    output_names=list(OUTPUTS), dynamic_shapes=dynamic, verbose=False)
    return save_program(program, out_path)


def _cases(drafter: EagleDrafter, seed: int = 0):
    """(past rows, tokens, positions, bool mask): a 6-row prefill, then a 4-node tree over it."""
    rng = np.random.default_rng(seed)
    v = drafter.embed.shape[0]
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    return [(0, rng.integers(0, v, 6), np.arange(6), causal_mask(0, 6)),
            (6, rng.integers(0, v, 4), np.array([6, 7, 7, 8]), np.concatenate([np.ones((4, 6), bool), tree], axis=1))]


def _scaled_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max(1, max |want|): e.g. want [50, -3], got [50.002, -3] -> 0.002 / 50 = 4e-5."""
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def compare_with_numpy(drafter: EagleDrafter, onnx_path: str, seed: int = 0) -> float:
    """Max |graph - numpy| / max(1, max |numpy|) per output (logits, hidden, new K/V) on `_cases` (the numpy
    drafter's cache is reset), the logits of every row and of the last alone: absolute for outputs of unit scale,
    relative above."""
    net = OnnxNet(onnx_path, threads=1, label=f"{drafter.kind} head")
    drafter.reset()
    rng = np.random.default_rng(seed + 1)
    worst = 0.0
    for past, tokens, positions, mask in _cases(drafter, seed):
        feats = rng.standard_normal((len(tokens), drafter.spec.hidden_size)).astype(np.float32)
        pk = drafter.cache.k[:past, 0].copy()
        pv = drafter.cache.v[:past, 0].copy()
        hidden = drafter._run(feats, tokens, positions, mask)
        want = {"logits": drafter._draft_logits(hidden), "hidden": hidden,
                "new_key": drafter.cache.k[past:past + len(tokens), 0], "new_value": drafter.cache.v[past:past + len(tokens), 0]}
        feeds = {"input_ids": np.asarray(tokens, np.int64), "features": feats,
                 "position_ids": np.asarray(positions, np.int64), "attention_mask": additive_mask(mask),
                 "past_key": pk, "past_value": pv}
        got = net.run({**feeds, "logit_rows": np.arange(len(tokens))})
        last = net.run({**feeds, "logit_rows": np.array([len(tokens) - 1])})["logits"]  # a catch-up's one row
        worst = max([worst, _scaled_error(last, want["logits"][-1:])] + [_scaled_error(got[n], want[n]) for n in OUTPUTS])
    drafter.reset()
    return worst


def export_and_check(drafter: EagleDrafter, out_path: str, label: str, validate: bool = True) -> Tuple[str, float]:
    """Export, then compare with numpy; ExportError (naming the graph and the error) over TOLERANCE."""
    export_eagle_onnx(drafter, out_path)
    err = compare_with_numpy(drafter, out_path) if validate else float("nan")
    print(f"{label}: max |onnx - numpy| / scale {err:.2e} (allowed {TOLERANCE:.0e})")
    if validate and not err <= TOLERANCE:
        raise ExportError(f"{label}: the EAGLE step graph differs from the numpy drafter by {err:.2e} (> {TOLERANCE:.0e} of "
                          "the output's scale); "
                          "the bundle was left unchanged (`--no-validate` writes the graphs anyway)")
    return out_path, err


def graph_params(drafter: EagleDrafter) -> Mapping:
    return {"precision": "fp32", "kind": drafter.kind, "inputs": list(INPUTS), "outputs": list(OUTPUTS)}


def bundle_heads(bundle, target_weights) -> Dict[str, Tuple[EagleDrafter, Tuple[str, ...]]]:
    """One numpy drafter per distinct EAGLE head of a bundle -> (drafter, the entries that share its weights):
    eagle and eagle2 (the same weights with a dynamic tree, possibly in two files) share one graph."""
    from runtime.backends.numpy_ref import cache_shape
    from runtime.config import BackendConfig
    from runtime.drafters.registry import build_drafter
    from runtime.memory.kv import KVArena

    heads: Dict[str, Tuple[EagleDrafter, Tuple[str, ...]]] = {}
    by_files: Dict[Tuple, str] = {}
    for name, entry in bundle.drafters.items():
        if entry.kind not in ("eagle", "eagle3"):
            continue
        key = (entry.kind, tuple(sha256_of(bundle.path(f)) for f in entry.files),
               repr(sorted((k, v) for k, v in entry.params.items() if k != "tree")))
        if key in by_files:
            first = by_files[key]
            heads[first] = (heads[first][0], heads[first][1] + (name,))
            continue
        arena = KVArena.for_context({"draft": cache_shape(entry.spec)}, 80)
        # numpy: the oracle the graph is checked against
        drafter = build_drafter(name, bundle, BackendConfig(kind="numpy_ref"), arena, 16, 4, 1, target_weights)
        by_files[key] = name
        heads[name] = (drafter, (name,))
    return heads
