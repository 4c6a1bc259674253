"""An MTP module as an ONNX graph (one graph per module), run by runtime/drafters/mtp.py through OnnxNet.

Contract (runtime.drafters.mtp.GRAPH_INPUTS / GRAPH_OUTPUTS), T new rows, P past rows of the module's cache:
  inputs   hidden          float32 (T, H)        the previous module's (module 0: the target's last layer) output
           input_ids       int64   (T,)          x_{t+1+i}
           position_ids    int64   (T,)
           attention_mask  float32 (T, P+T)      additive
           past_key/value  kv      (P, nkv, d)   the module's own cache rows
  outputs  logits          float32 (1, V)        the last row's (the only one drafting reads)
           hidden_out      float32 (T, H)        the module's output, before its out norm (the next module's input)
           new_key/value   kv      (T, nkv, d)   only the new rows; the drafter writes them into its cache
The decoder layer, rope and attention are export/onnx/graph.py's DecoderGraph blocks; the graph's copy of the
target's embedding / LM head points at the target graph's data file (share_initializers), so a bundle
holds them once. The numpy module (runtime.drafters.mtp.MTPModule) is the oracle the export is checked against."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping

import numpy as np
import torch

from export.library_logs import quiet_library
from export.onnx.graph import (OPSET, PRECISIONS, DecoderGraph, rms_norm, check_against_reference, save_program,
                         share_initializers)
from runtime.backends.onnx_net import OnnxNet
from runtime.drafters.mtp import GRAPH_INPUTS, GRAPH_OUTPUTS, MTPModule, module_keys, mtp_cache_shape
from runtime.memory.kv import KVArena
from runtime.model.spec import ModelSpec


def _module(spec: ModelSpec, weights: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray], layout: str,
            index: int, first_layer: int, cache=None, net=None) -> MTPModule:
    embed = np.ascontiguousarray(target["model.embed_tokens.weight"], np.float32)
    head = embed if spec.tie_word_embeddings else np.ascontiguousarray(target["lm_head.weight"], np.float32)
    return MTPModule(spec, weights, module_keys(layout, index, first_layer), layout, cache, embed, head, net)


class MTPModuleGraph(DecoderGraph):
    """One MTP module (see the module docstring), its weights taken from the numpy module (MiMo's projection
    columns already in [emb, hidden] order, its own head or the target's)."""

    def __init__(self, module: MTPModule, precision: str):
        own = {"mtp.emb_norm": module.norms["emb_norm"], "mtp.hidden_norm": module.norms["hidden_norm"],
               "mtp.out_norm": module.norms["out_norm"], "mtp.proj": module.proj, "embed": module.embed}
        self.tied = module.head is module.embed
        if not self.tied:
            own["head"] = module.head
        weights = {**module.w, **own}
        super().__init__(module.spec, weights, (), precision, names=list(weights))
        self.layer = module.prefix

    def forward(self, hidden, input_ids, position_ids, attention_mask, past_key, past_value):
        eps = self.spec.rms_norm_eps
        e = rms_norm(self.w("embed")[input_ids], self.w("mtp.emb_norm"), eps)  # (T, H)
        h = rms_norm(hidden.to(self.dtype), self.w("mtp.hidden_norm"), eps)
        x = torch.cat([e, h], dim=-1) @ self.w("mtp.proj").t()  # (T, H)
        cos, sin = self.rope(position_ids)
        out, k, v = self.decoder_layer(self.layer, x, cos, sin, past_key, past_value, attention_mask)
        head = self.w("embed") if self.tied else self.w("head")
        logits = (rms_norm(out[-1:], self.w("mtp.out_norm"), eps) @ head.t()).float()  # (1, V)
        return logits, out.float(), k, v


def export_mtp_module_onnx(module: MTPModule, out_path: str, precision: str = "fp32") -> str:
    """Write one module's graph to out_path (+ .data). Returns out_path."""
    graph = MTPModuleGraph(module, precision).eval()
    spec, dt = module.spec, PRECISIONS[precision]
    t, p = 3, 5  # example sizes, both dynamic (avoid 0/1, which torch.export specialises)
    kv = (p, spec.num_kv_heads, spec.head_dim)
    args = (torch.zeros(t, spec.hidden_size), torch.zeros(t, dtype=torch.int64), torch.arange(p, p + t),
            torch.zeros(t, p + t), torch.zeros(kv, dtype=dt), torch.zeros(kv, dtype=dt))
    T, P, S = torch.export.Dim("T"), torch.export.Dim("P"), torch.export.Dim("S")
    dynamic = {"hidden": {0: T}, "input_ids": {0: T}, "position_ids": {0: T}, "attention_mask": {0: T, 1: S},
               "past_key": {0: P}, "past_value": {0: P}}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with torch.no_grad(), quiet_library():  # torch.onnx's notes and warnings about itself (--verbose shows them)
        program = torch.onnx.export(graph, args, dynamo=True, opset_version=OPSET, input_names=list(GRAPH_INPUTS),
                                    output_names=list(GRAPH_OUTPUTS), dynamic_shapes=dynamic, verbose=False)
    return save_program(program, out_path)


def validate_mtp_onnx(module_args: tuple, onnx_path: str, precision: str = "fp32", verbose: bool = True) -> float:
    """Run the graph (through the runtime's MTPModule + OnnxNet) and the numpy module on the same rows: a
    prefill of 7 rows, one decode row, then 3 rows on that past. Returns the max relative error over
    logits and output hiddens (|a-b|max / |b|max)."""
    spec = module_args[0]
    rng = np.random.default_rng(0)
    runs = []
    for dtype, net in ((np.float32, None), (np.float16 if precision == "fp16" else np.float32, OnnxNet(onnx_path))):
        cache = KVArena.for_context({"m": mtp_cache_shape(spec)}, 16, dtype).allocate("m", mtp_cache_shape(spec), 16)
        runs.append(_module(*module_args, cache=cache, net=net))
    worst, pos = 0.0, 0
    for t in (7, 1, 3):
        hidden = rng.normal(0, 1, (t, spec.hidden_size)).astype(np.float32)
        ids = rng.integers(0, spec.vocab_size, t)
        (ref_h, ref_l), (got_h, got_l) = (m.run(hidden, ids, pos) for m in runs)
        errs = {"logits": _rel(got_l, ref_l), "hidden_out": _rel(got_h, ref_h)}
        worst = max(worst, *errs.values())
        if verbose:
            print(f"  T={t} P={pos:2d}  " + "  ".join(f"{k} max rel err {v:.2e}" for k, v in errs.items()))
        pos += t
    if verbose:
        print(f"{onnx_path}: max rel error vs the numpy MTP module {worst:.2e} ({precision})")
    return worst


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - b)) / max(float(np.max(np.abs(b))), 1e-12))


@dataclass
class MTPGraphs:
    """The graphs of one bundle drafter of kind mtp: module i -> files[2i], files[2i+1] (graph, data)."""
    name: str
    files: List[str]
    params: dict


def mtp_graph_files(name: str, modules: int, precision: str) -> List[str]:
    out = []
    for i in range(modules):
        g = f"onnx/drafter.{name}.{precision}.onnx" if i == 0 else f"onnx/drafter.{name}.module{i}.{precision}.onnx"
        out += [g, g + ".data"]
    return out


def export_bundle_mtp(bundle, name: str, entry, target_weights: Mapping[str, np.ndarray], staging: str,
                      target_graph: str, precision: str, validate: bool, weights: Mapping[str, np.ndarray],
                      kstep: bool = False) -> MTPGraphs:
    """Export every module of drafter `name` into `staging` (checked against numpy when `validate`; ExportError
    over the precision's tolerance), its vocab matrices shared with the staged target graph `target_graph`; with
    `kstep` and a single module, also its K-step chain graph (K = the entry's num_tokens, default 4)."""
    spec = bundle.target.spec
    modules = int(entry.params.get("num_modules", 1))
    layout = str(entry.params.get("layout", "deepseek_v3"))
    first = int(entry.params.get("first_layer_index", spec.num_layers))
    files = mtp_graph_files(name, modules, precision)
    for i in range(modules):
        args = (spec, weights, target_weights, layout, i, first)
        staged = os.path.join(staging, os.path.basename(files[2 * i]))
        export_mtp_module_onnx(_module(*args), staged, precision)
        share_initializers(staged, target_graph)
        if validate:
            check_against_reference(f"{bundle.root}/{files[2 * i]} (drafter {name}, module {i})",
                                    validate_mtp_onnx(args, staged, precision), precision)
    params = {"precision": precision, "modules": modules, "layout": layout}
    if kstep and modules == 1:
        from export.drafters import head_kstep

        steps = int(entry.params.get("num_tokens", 4))
        krel = f"onnx/drafter.{name}.kstep{steps}.{precision}.onnx"
        kstaged = os.path.join(staging, os.path.basename(krel))
        export_and_check_kstep((spec, weights, target_weights, layout, 0, first), kstaged, steps, precision,
                               f"{bundle.root}/{krel} (drafter {name})", validate)
        share_initializers(kstaged, os.path.join(staging, os.path.basename(files[0])))  # the module, stored once
        share_initializers(kstaged, target_graph)
        files += [krel, krel + ".data"]
        params.update(head_kstep.kstep_params(steps, krel, kstaged))
    return MTPGraphs(name, files, params)



# -- a single module's chain in one run (export/drafters/head_kstep.py) ----------------------------------------

def _kstep_graph(module: MTPModule, steps: int, precision: str):
    from export.drafters import head_kstep

    class Graph(head_kstep.KStepHeadGraph):
        """A single MTP module reused on its own output (as runtime/drafters/mtp.py chains it)."""

        def __init__(self):
            super().__init__(steps, module.spec.vocab_size)
            self.module = MTPModuleGraph(module, precision)

        def step(self, input_ids, features, position_ids, attention_mask, past_key, past_value):
            logits, hidden, k, v = self.module(features, input_ids, position_ids, attention_mask, past_key, past_value)
            return logits[-1], hidden.to(features.dtype), k, v

    return Graph()


def export_and_check_kstep(module_args: tuple, out_path: str, steps: int, precision: str, label: str,
                           validate: bool = True) -> str:
    """A single module's K-step chain graph at `precision`, its chain logic checked against the numpy MTPDrafter's
    step-wise chain on the same draws (ExportError over 1e-4). The check runs the float32 build of the same graph
    (an fp16 run's near-ties would draw other tokens than the float32 reference); the fp16 arithmetic of the step
    is the module graph's, checked by `validate_mtp_onnx`."""
    from export.drafters import head_kstep

    spec = module_args[0]
    kv = (spec.num_kv_heads, spec.head_dim)
    head_kstep.export_kstep(_kstep_graph(_module(*module_args), steps, precision), out_path, spec.hidden_size, kv,
                            precision)
    if not validate:
        return out_path
    check = out_path if precision == "fp32" else out_path[:-len(".onnx")] + ".check32.onnx"
    if check != out_path:
        head_kstep.export_kstep(_kstep_graph(_module(*module_args), steps, "fp32"), check, spec.hidden_size, kv)
    try:
        err = _compare_kstep(module_args, check, steps)
    finally:
        if check != out_path:
            for f in (check, check + ".data"):
                if os.path.exists(f):
                    os.remove(f)
    head_kstep.check(label, err, 1e-4)
    return out_path


def _compare_kstep(module_args: tuple, path: str, steps: int) -> float:
    from export.drafters import head_kstep
    from runtime.drafters.heads import HeadKStep
    from runtime.drafters.mtp import MTPDrafter

    spec, weights, target, layout, _, first = module_args
    shape = mtp_cache_shape(spec)
    caches = [KVArena.for_context({"m": shape}, 32).allocate("m", shape, 32) for _ in range(2)]
    embed = np.ascontiguousarray(target["model.embed_tokens.weight"], np.float32)
    head = embed if spec.tie_word_embeddings else np.ascontiguousarray(target["lm_head.weight"], np.float32)
    ref = MTPDrafter(spec, weights, embed, head, [caches[0]], num_tokens=steps, layer_index=first, layout=layout)
    ks = HeadKStep(path, steps)
    hidden = np.random.default_rng(1).normal(0, 1, (8, spec.hidden_size)).astype(np.float32)

    def run_kstep(context, params, u):
        caches[1].reset()
        return ks.run(caches[1], context[1:], hidden, np.arange(len(context) - 1), params, context, u)

    def stepwise(context, ctx):
        ref.reset()
        ref.pending[0] = list(hidden)
        return ref.propose(ctx)

    return head_kstep.compare_with_stepwise(path, steps, spec.vocab_size, run_kstep, stepwise)
