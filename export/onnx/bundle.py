"""`edgespec export --to onnx` for a whole bundle: the target graph (each precision), the draft model's graph and
every drafter's own graphs (MTP modules, Medusa heads, EAGLE steps, DFlash blocks), each checked against the numpy
reference, staged and then sealed into the manifest atomically. The graph library it builds with is
export/onnx/graph.py; the drafter graphs live with their drafters (export/drafters/*_onnx.py), each kind's export
reached through export/drafters/registry.py."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from typing import Collection, Mapping, Optional, Sequence, Tuple

from export.drafters import registry
from export.onnx.graph import (KV_LAYOUTS, check_against_reference, export_decoder_onnx, graph_weight_bytes,
                               safetensors_weights, share_initializers, validate_onnx)
from export.onnx.kstep import export_and_check_kstep, kstep_rel
from export.onnx.fused import export_fused_onnx
from export.onnx.quantize import ACCURACY_LEVEL, BITS, quantize_graph
from runtime.errors import BundleError, ExportError
from runtime.model import bundle as bundle_mod
from runtime.model.bundle import ONNX_PRECISIONS, onnx_entry_key


def add_onnx_to_bundle(bundle_dir: str, precision: str = "fp32", taps: Optional[Sequence[str]] = None,
                       validate: bool = True, block_size: int = 32,
                       accuracy_level: Optional[int] = None, attention: str = "auto",
                       only: Optional[Collection[str]] = None, kstep: str = "auto") -> Tuple[str, ...]:
    """Export the bundle's target (from its numpy_ref safetensors) to ONNX and register it as backend
    "onnx"; likewise every `draft_model` drafter that has a spec and safetensors (with its K-step draft graph,
    export/onnx/kstep.py, K = its params.num_tokens, where its attention is the default and `kstep` asks for it:
    "auto" = with fp16, the GPU precision, where the runtime's params.kstep "auto" takes it; on the 2-core CPU the
    step-wise chain ran faster and the graph's export costs ~25 s; "on" | "off"), and every MTP module; an EAGLE
    chain's head gets its K-step graph under the same rule (export/drafters/eagle_kstep.py).
    Taps default to every tap the bundle's drafters read, plus final_norm. Returns the new files (relative to the bundle).

    precision int8 / int4: the target's fp32 graph, weight-only quantised by ONNX Runtime's MatMulNBits
    quantiser (export/onnx/quantize.py, blocks of `block_size`), registered NEXT to the float graph as
    entry "onnx.int8" / "onnx.int4" (`backend.precision` selects it); drafters are not quantised.

    attention "gqa": every graph's attention is ONNX Runtime's GroupQueryAttention over a shared past/present
    buffer (export/onnx/gqa.py; recorded as params attention / kv_layout), "matmul" the grouped MatMuls, "fused"
    the node-by-node graph of ONNX Runtime's fused ops (export/onnx/fused.py). "auto" (default): see
    `graph_attention`.

    Every graph is written into a scratch directory inside the bundle and checked against the numpy
    reference there (validate=True); only when all pass do they move into onnx/ and bundle.yaml change.
    A graph over TOLERANCE raises ExportError and leaves the bundle exactly as it was.

    only: export just these drafters' graphs (drafters added to the bundle, `edgespec bundle add-drafter`) beside
    the target graph already there, which stays as it is, byte for byte: they share its vocab matrices as the
    full export's do. The float precision only, and the target graph must hold every tap they read."""
    b = bundle_mod.load(bundle_dir)
    if taps is None:
        taps = sorted({"final_norm"} | {t for d in b.drafters.values() for t in d.target_taps})
    weights = safetensors_weights(b, b.target_files("numpy_ref").files)
    if not weights:
        raise BundleError(f"{bundle_dir}: the numpy_ref target lists no .safetensors files to export from")
    if precision not in ONNX_PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {list(ONNX_PRECISIONS)}")
    quantised = precision in BITS
    if quantised and attention in ("gqa", "fused"):
        # Measured on the zoo: the op's T-row and 1-row paths round differently and int8 activation rounding
        # magnifies that to logit gaps of ~1e-3, so a speculative greedy output left plain greedy's (README).
        export = f"edgespec export --to onnx --bundle {bundle_dir} --precision {precision}"  # a valid precision
        raise ExportError(f"--attention {attention} with --precision {precision}: not exported, because greedy speculative "
                          "output on such a graph differed from plain greedy output beyond float near-ties; export "
                          f"the {precision} graph with the default attention: `{export}`")
    level = ACCURACY_LEVEL.get(precision, 0) if accuracy_level is None else accuracy_level
    rel = f"onnx/target.{precision}.onnx"
    graphs = [("target", rel, b.target.spec, weights, tuple(taps))]
    if only is not None:
        rel = _kept_target_graph(b, precision, only)
        graphs = []
        b = replace(b, drafters={n: d for n, d in b.drafters.items() if n in only})  # the drafters to export
    for name, d in b.drafters.items():
        if quantised or not registry.is_decoder(d.kind) or d.spec is None:
            continue  # the other kinds' graphs: their own exporters (export/drafters/kinds/), below
        dw = safetensors_weights(b, d.files)
        if dw:
            graphs.append((name, f"onnx/drafter.{name}.{precision}.onnx", d.spec, dw, ()))
    # K-step draft graphs (one run per drafted chain): layer-major K/V only, as the step graph they share weights with
    ksteps = {} if not kstep_wanted(kstep, precision) or quantised or graph_attention(attention, precision, False) != "matmul" else {
        label: (kstep_rel(label, precision, int(b.drafters[label].params.get("num_tokens", 4))),
                int(b.drafters[label].params.get("num_tokens", 4))) for label, *_ in graphs if label != "target"}

    writer = bundle_mod.BundleWriter.extend(bundle_dir)  # reads (and checks) the manifest before any file changes
    staging = tempfile.mkdtemp(prefix=".onnx-export-", dir=bundle_dir)
    try:
        if only is not None:  # the kept target graph beside the new graphs, whose vocab matrices point into its data
            os.link(os.path.join(bundle_dir, rel), os.path.join(staging, os.path.basename(rel)))
            # a copy, not a link: onnx's checker refuses external data with several hard links, which the data
            # file has while the bundle is edited through a hard-linked copy (export/bundle/edit.py)
            shutil.copyfile(os.path.join(bundle_dir, rel + ".data"), os.path.join(staging, os.path.basename(rel) + ".data"))
        for label, grel, spec, w, gtaps in graphs:
            staged = os.path.join(staging, os.path.basename(grel))
            if quantised:
                float_graph = export_decoder_onnx(spec, w, os.path.join(staging, "float.fp32.onnx"), gtaps, "fp32",
                                                  graph_attention(attention, precision, label == "target"))
                quantize_graph(float_graph, staged, precision, spec.vocab_size, block_size, level)
            else:
                export_graph(spec, w, staged, gtaps, precision, graph_attention(attention, precision, label == "target"))
            if label != "target":  # a vocab matrix the draft shares with the target is stored once
                share_initializers(staged, os.path.join(staging, os.path.basename(rel)))
            if validate:
                check_against_reference(f"{bundle_dir}/{grel} ({label})",
                                        validate_onnx(spec, w, staged, gtaps, precision), precision)
            if label in ksteps:
                krel, steps = ksteps[label]
                export_and_check_kstep(spec, w, os.path.join(staging, os.path.basename(krel)), steps, precision, staged,
                                       f"{bundle_dir}/{krel} ({label})", validate)
        target_graph = os.path.join(staging, os.path.basename(rel))
        # Every other drafter graph (drafter, files, params), by its kind's exporter, written into staging and checked
        extra = [] if quantised else registry.graphs(
            registry.GraphJob(b, staging, target_graph, weights, precision, validate, kstep_wanted(kstep, precision)))
        os.makedirs(os.path.join(bundle_dir, "onnx"), exist_ok=True)
        moved = {grel + suffix for _, grel, *_ in graphs for suffix in ("", ".data")} | {f for e in extra for f in e[1]}
        moved |= {krel + suffix for krel, _ in ksteps.values() for suffix in ("", ".data")}
        if only is not None:
            moved -= {rel, rel + ".data"}  # the target graph stays as it is
        for f in sorted(moved):
            os.replace(os.path.join(staging, os.path.basename(f)), os.path.join(bundle_dir, f))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    before = _listed_backend_files(writer.manifest)
    written = []
    for label, grel, _, _, gtaps in graphs:
        files = [grel, grel + ".data"]
        kind = graph_attention(attention, precision, label == "target")
        params = {"precision": precision, "taps": list(gtaps), "kv_layout": KV_LAYOUTS[kind]}
        if kind != "matmul":
            params["attention"] = kind
        if quantised:
            params.update(block_size=block_size, accuracy_level=level,
                          quantizer="onnxruntime MatMulNBits, symmetric, LM head float32")
        if label in ksteps:  # the K-step graph rides in the draft model's onnx entry
            krel, steps = ksteps[label]
            files += [krel, krel + ".data"]
            params.update(kstep_graph=krel, kstep_steps=steps,
                          kstep_weight_bytes=graph_weight_bytes(os.path.join(bundle_dir, krel)))
        if label == "target":
            writer.add_target_backend(onnx_entry_key(precision), files, params)
        else:
            writer.add_drafter_backend(label, "onnx", files, params)
        written += files
    for name, files, params in extra:
        writer.add_drafter_backend(name, "onnx", files, params)
        written += [f for f in files if f not in written]
    # One ONNX entry per model: the files of the entry just replaced (another precision) are removed, as
    # the manifest listed them, so that no orphan graph is left on disk. Nothing unlisted is touched.
    listed = set(writer.manifest.get("files") or {})
    for stale in sorted((before - _listed_backend_files(writer.manifest)) & listed):
        os.remove(os.path.join(bundle_dir, stale))
        print(f"{bundle_dir}/{stale}: removed (replaced by the {precision} export)")
    writer.write()
    return tuple(written)


def export_graph(spec, weights, out_path: str, taps, precision: str, attention: str) -> str:
    """One decoder graph: the fused graph (export/onnx/fused.py) or the traced one (export/onnx/graph.py)."""
    if attention == "fused":
        return export_fused_onnx(spec, weights, out_path, taps, precision)
    return export_decoder_onnx(spec, weights, out_path, taps, precision, attention)


def kstep_wanted(kstep: str, precision: str) -> bool:
    """Whether an export writes the draft model's K-step graph: "on", "off", or for "auto" with fp16 only (the GPU
    graph, where the runtime's params.kstep "auto" runs it).

    >>> [kstep_wanted("auto", p) for p in ("fp32", "fp16")], kstep_wanted("on", "fp32"), kstep_wanted("off", "fp16")
    ([False, True], True, False)"""
    return kstep == "on" or (kstep == "auto" and precision == "fp16")


def graph_attention(attention: str, precision: str, target: bool) -> str:
    """The attention a decoder graph is exported with: `attention` as asked, or for "auto" the fused graph for an
    fp32 target (a decode step measured 1.4-2.2x faster than the traced matmul graph's on the zoo, CPU) and the
    matmul graph for the rest: fp16 (the GPU precision: ONNX Runtime's CUDA GroupQueryAttention refuses an
    attention_bias, i.e. tree masks, and TensorRT parses no contrib op), int8 / int4 (weight-only quantisation of the
    fused graph is not checked for greedy identity) and draft models (their step-wise and K-step graphs keep the
    layer-major arena layout).

    >>> [graph_attention("auto", p, True) for p in ("fp32", "fp16", "int8")], graph_attention("auto", "fp32", False)
    (['fused', 'matmul', 'matmul'], 'matmul')"""
    if attention != "auto":
        return attention
    return "fused" if target and precision == "fp32" else "matmul"


def _kept_target_graph(b, precision: str, only: Collection[str]) -> str:
    """The target graph (relative path) an `only` export shares: the bundle's float graph of `precision`,
    holding every tap the drafters `only` read; else a BundleError saying what to export instead."""
    entry = b.target.backends.get("onnx")
    have = entry.params.get("precision", "fp32") if entry is not None else None
    if have != precision or precision not in ("fp32", "fp16"):
        raise BundleError(f"{b.root}: exporting drafters {sorted(only)} alone needs the target's {precision} ONNX "
                          f"graph (the bundle's float graph is {have or 'absent'}); run `edgespec export --to onnx "
                          f"--bundle {b.root}`")
    rel = f"onnx/target.{precision}.onnx"
    if tuple(entry.files[:2]) != (rel, rel + ".data"):
        raise BundleError(f"{b.root}: target.backends.onnx lists {list(entry.files)}, expected [{rel}, {rel}.data]; "
                          f"re-export with `edgespec export --to onnx --bundle {b.root}`")
    missing = sorted({t for n in only for t in b.drafters[n].target_taps} - set(entry.params.get("taps") or ()))
    if missing:
        raise BundleError(f"{b.root}: the target graph has no taps {missing}, which drafters {sorted(only)} read; "
                          f"re-export it with `edgespec export --to onnx --bundle {b.root}`")
    return rel


def _listed_backend_files(manifest: Mapping) -> set:
    """Every file a target or drafter backend entry of a manifest names."""
    entries = list((manifest["target"].get("backends") or {}).values())
    for d in (manifest.get("drafters") or {}).values():
        entries += list((d.get("backends") or {}).values())
    return {f for e in entries for f in e.get("files", ())}
