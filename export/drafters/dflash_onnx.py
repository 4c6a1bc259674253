"""The DFlash / DFlash-2 block forward as an ONNX graph (run by runtime/backends/onnx_net.py `OnnxNet`).

Graph contract (one graph per weight file; every block size uses it):
    inputs   context (C, n*H) fused target taps of the newly committed rows,
             block (B, H) the embedded block [anchor, mask, ...] (the embedding stays the target's, in numpy),
             context_cos / context_sin (C, d), block_cos / block_sin (B, d) rotary tables at their positions,
             past_key_i / past_value_i (P, nkv, d) the context rows already cached, per draft layer
    outputs  hidden (B-1, H) the final-normed draft slots (the runtime applies the target's LM head),
             new_key_i / new_value_i (C, nkv, d) the new context rows' K/V, which the drafter writes into
             its own cache (the block's rows never leave the graph)
The DFlash-2 path selector's walk stays in numpy (it samples). The numpy drafter is the oracle: the export
runs both on the same cycles and fails with ExportError past TOLERANCE."""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Tuple

import numpy as np
import torch
import torch.nn as nn

from export.library_logs import quiet_library
from export.onnx.graph import OPSET, save_program
from runtime.drafters.dflash import DFlashParams, dflash_weight_names
from runtime.errors import ExportError
from runtime.model.spec import ModelSpec

TOLERANCE = 1e-4  # max |numpy - onnx| over the draft logits, relative to their max |value|


def input_names(layers: int) -> List[str]:
    return (["context", "block", "context_cos", "context_sin", "block_cos", "block_sin"]
            + [f"past_key_{i}" for i in range(layers)] + [f"past_value_{i}" for i in range(layers)])


def output_names(layers: int) -> List[str]:
    return ["hidden"] + [f"new_key_{i}" for i in range(layers)] + [f"new_value_{i}" for i in range(layers)]


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


class DFlashGraph(nn.Module):
    """runtime.drafters.dflash.DFlashDrafter.forward in torch, weights baked in as float32 initializers."""

    def __init__(self, spec: ModelSpec, params: DFlashParams, weights: Mapping[str, np.ndarray]):
        super().__init__()
        self.spec, self.p = spec, params
        for name in dflash_weight_names(spec, params):
            self.register_buffer(name.replace(".", "__"), torch.from_numpy(np.asarray(weights[name], np.float32).copy()))

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))

    def _lin(self, x, name, bias=False):
        y = x @ self.w(name + ".weight").T
        return y + self.w(name + ".bias") if bias else y

    def _mixed(self, pre, h):
        """(conv_in(h), output kernel) for DFlash-2, (h, None) for DFlash (runtime `mixed`)."""
        if not self.p.v2:
            return h, None
        base = self.w(pre + ".base_kernel")  # (in/out, tap, H)
        dyn = self._lin(h, pre + ".kernel_projection").reshape(h.shape[0], 2, 2, -1)
        dyn = dyn.repeat_interleave(self.p.conv_group_size, -1)  # (B, in/out, tap, H)
        k_in, k_out = base[0] + dyn[:, 0], base[1] + dyn[:, 1]
        return self._mix(h, k_in), k_out

    @staticmethod
    def _mix(x, k):
        prev = torch.cat([torch.zeros_like(x[:1]), x[:-1]], 0)
        return k[:, 0] * x + k[:, 1] * prev

    def forward(self, context, block, context_cos, context_sin, block_cos, block_sin, past_keys, past_values):
        s, eps = self.spec, self.spec.rms_norm_eps
        nh, nkv, d, bias = s.num_heads, s.num_kv_heads, s.head_dim, s.qkv_bias
        ctx = _rms(context @ self.w("fc.weight").T, self.w("hidden_norm.weight"), eps)  # (C, H)
        x = block
        c, b = ctx.shape[0], block.shape[0]
        new_k, new_v = [], []
        for i in range(s.num_layers):
            pre = f"layers.{i}."
            h, k_out = self._mixed(pre + "attention_conv", _rms(x, self.w(pre + "input_layernorm.weight"), eps))
            q = _rope(_rms(self._lin(h, pre + "self_attn.q_proj", bias).reshape(b, nh, d),
                           self.w(pre + "self_attn.q_norm.weight"), eps), block_cos, block_sin)

            def kv(rows, cos, sin, n):
                k = _rms(self._lin(rows, pre + "self_attn.k_proj", bias).reshape(n, nkv, d),
                         self.w(pre + "self_attn.k_norm.weight"), eps)
                return _rope(k, cos, sin), self._lin(rows, pre + "self_attn.v_proj", bias).reshape(n, nkv, d)

            kc, vc = kv(ctx, context_cos, context_sin, c)
            kb, vb = kv(h, block_cos, block_sin, b)
            new_k.append(kc)
            new_v.append(vc)
            keys = torch.cat([past_keys[i], kc, kb], 0).repeat_interleave(nh // nkv, 1)  # (S, nh, d)
            vals = torch.cat([past_values[i], vc, vb], 0).repeat_interleave(nh // nkv, 1)
            probs = torch.softmax(torch.einsum("bhd,shd->hbs", q, keys) * (d ** -0.5), -1)  # no mask: all visible
            o = torch.einsum("hbs,shd->bhd", probs, vals).reshape(b, nh * d) @ self.w(pre + "self_attn.o_proj.weight").T
            x = x + (o if k_out is None else self._mix(o, k_out))
            h, k_out = self._mixed(pre + "mlp_conv", _rms(x, self.w(pre + "post_attention_layernorm.weight"), eps))
            m = torch.nn.functional.silu(self._lin(h, pre + "mlp.gate_proj")) * self._lin(h, pre + "mlp.up_proj")
            m = self._lin(m, pre + "mlp.down_proj")
            x = x + (m if k_out is None else self._mix(m, k_out))
        return (_rms(x[1:], self.w("norm.weight"), eps), *new_k, *new_v)


def export_dflash_onnx(spec: ModelSpec, params: DFlashParams, weights: Mapping[str, np.ndarray], out_path: str) -> str:
    """Write the block forward to `out_path` (+ `out_path`.data); C, B and P are dynamic. Returns out_path."""
    module = DFlashGraph(spec, params, weights).eval()
    n_in = weights["fc.weight"].shape[1]
    L, nkv, d, h = spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    c, b, p = 3, 5, 4  # example sizes; all exported dynamic (avoid 0/1, which torch.export specialises)
    args = (torch.zeros(c, n_in), torch.zeros(b, h), torch.zeros(c, d), torch.zeros(c, d), torch.zeros(b, d),
            torch.zeros(b, d), [torch.zeros(p, nkv, d) for _ in range(L)], [torch.zeros(p, nkv, d) for _ in range(L)])
    C, B, P = torch.export.Dim("C"), torch.export.Dim("B", min=2), torch.export.Dim("P")
    dynamic = {"context": {0: C}, "block": {0: B}, "context_cos": {0: C}, "context_sin": {0: C},
               "block_cos": {0: B}, "block_sin": {0: B}, "past_keys": [{0: P}] * L, "past_values": [{0: P}] * L}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():  # torch.onnx's notes and warnings about itself (--verbose shows them)
        program = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, input_names=input_names(L),
                                    output_names=output_names(L), dynamic_shapes=dynamic, verbose=False)
    return save_program(program, out_path)


def compare_with_numpy(spec: ModelSpec, params: DFlashParams, weights: Mapping[str, np.ndarray], graph: str,
                       embed: np.ndarray, head: np.ndarray, cycles: int = 3, seed: int = 0) -> float:
    """Max |logits difference| / max |logit| between the numpy drafter and the same drafter on `graph`, over
    `cycles` cycles of random context rows (a prompt, then a few committed rows per cycle), block sizes
    block_size and 8 (when smaller)."""
    from runtime.backends.onnx_net import OnnxNet
    from runtime.drafters.dflash import DFlashDrafter
    from runtime.memory.kv import CacheShape, KVArena

    net = OnnxNet(graph, label="dflash")
    rng = np.random.default_rng(seed)
    taps = [f"layer_out.{i}" for i in params.target_layer_ids]
    shape = CacheShape(spec.num_layers, spec.num_kv_heads, spec.head_dim)
    arena = KVArena.for_context({"a": shape, "b": shape}, 256)
    pair = [DFlashDrafter(spec, params, weights, embed, head, arena.allocate(k, shape, 128), net=n)
            for k, n in (("a", None), ("b", net))]
    worst = 0.0
    rows, pos = 9, 0
    for cycle in range(cycles):
        feats = {t: rng.standard_normal((rows, embed.shape[1])).astype(np.float32) for t in taps}
        anchor = int(rng.integers(embed.shape[0]))
        block = params.block_size if cycle % 2 == 0 else min(8, params.block_size)
        out = []
        for drafter in pair:
            (drafter.begin if cycle == 0 else lambda _p, t: drafter.accept([], [], t))([], feats)
            out.append(drafter.forward(anchor, pos + rows, block)[1])
        pos += rows
        rows = int(rng.integers(1, 5))
        worst = max(worst, float(np.abs(out[0] - out[1]).max() / max(np.abs(out[0]).max(), 1e-30)))
    return worst


def export_and_check(spec: ModelSpec, params: DFlashParams, weights: Mapping[str, np.ndarray], out_path: str,
                     shown: str, embed: np.ndarray, head: np.ndarray, validate: bool = True) -> str:
    export_dflash_onnx(spec, params, weights, out_path)
    if validate:
        err = compare_with_numpy(spec, params, weights, out_path, embed, head)
        if not err <= TOLERANCE:
            raise ExportError(f"{shown}: the DFlash graph's logits differ from the numpy drafter's by {err:.2e} "
                              f"(relative; tolerance {TOLERANCE:g}); the bundle is unchanged")
    return out_path


def embed_and_head(target_weights: Mapping[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """The target's embedding and LM head (the embedding when tied), float32: what the drafter runs on."""
    embed = np.asarray(target_weights["model.embed_tokens.weight"], np.float32)
    head = target_weights.get("lm_head.weight")
    return embed, embed if head is None else np.asarray(head, np.float32)


def bundle_graphs(b) -> Dict[str, Tuple[Tuple, List[str]]]:
    """{graph name: ((spec, params, weights), drafter entries using it)}: one graph per DFlash weight file
    (`dflash` and `dflash_b8` share one)."""
    from runtime.backends.factory import load_weights

    out: Dict[str, Tuple[Tuple, List[str]]] = {}
    by_file: Dict[Tuple[str, ...], str] = {}
    for name, d in b.drafters.items():
        if d.kind not in ("dflash", "dflash2") or d.spec is None:
            continue
        key = tuple(d.files)
        if key in by_file:
            out[by_file[key]][1].append(name)
            continue
        params = DFlashParams.from_dict(d.params, f"drafters.{name}.params")
        by_file[key] = name
        out[name] = ((d.spec, params, load_weights(b, d.files)), [name])
    return out
