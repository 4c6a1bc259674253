"""Medusa heads as ONE ONNX graph: every head's ResBlocks and vocabulary projection in a single call.

    hidden (H,) float32  ->  logits (K, V) float32        K heads, all reading the same hidden

The graph holds the heads stacked (K, H, H) / (K, H) / (K, V, H), so a cycle's drafting is one ORT call instead
of 2 numpy products per layer. `runtime/drafters/medusa.py` runs it through `OnnxNet`; its numpy path is the
oracle the export is checked against (max |diff| <= TOLERANCE on random hiddens, else ExportError).
`medusa` and `medusa_chain` read the same head file, so they share one graph."""
from __future__ import annotations

import os
import tempfile
from typing import Dict, List, Mapping, Tuple

import numpy as np
import torch
from torch import nn

from export.library_logs import quiet_library
from export.onnx.graph import OPSET, save_program
from runtime.backends.onnx_net import OnnxNet
from runtime.drafters.medusa import MedusaDrafter
from runtime.errors import ExportError
from runtime.model.tensors import read_safetensors

TOLERANCE = 1e-4  # max |logit difference| against the numpy heads (fp32 measures ~1e-6: summation order)


class MedusaGraph(nn.Module):
    def __init__(self, drafter: MedusaDrafter):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.from_numpy(w.copy()), requires_grad=False) for w in drafter.w])
        self.b = nn.ParameterList([nn.Parameter(torch.from_numpy(b.copy()), requires_grad=False) for b in drafter.b])
        self.out = nn.Parameter(torch.from_numpy(drafter.out.copy()), requires_grad=False)  # (K, V, H)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        K = self.out.shape[0]
        x = hidden.reshape(1, -1, 1).expand(K, -1, 1)  # (K, H, 1)
        for w, b in zip(self.w, self.b):
            x = x + nn.functional.silu(torch.bmm(w, x) + b.unsqueeze(-1))  # ResBlock: x + SiLU(W x + b)
        return torch.bmm(self.out, x).squeeze(-1)  # (K, V)


def export_medusa_onnx(weights: Mapping[str, np.ndarray], out_path: str) -> str:
    """Write the heads' graph to `out_path` (+ `out_path`.data). Returns out_path."""
    drafter = MedusaDrafter(weights)
    module = MedusaGraph(drafter).eval()
    H = drafter.out.shape[2]
    with torch.no_grad(), quiet_library():  # torch.onnx's notes and warnings about itself (--verbose shows them)
        program = torch.onnx.export(module, (torch.zeros(H),), dynamo=True, opset_version=OPSET,
                                    input_names=["hidden"], output_names=["logits"], verbose=False)
    return save_program(program, out_path)


def check_medusa_onnx(weights: Mapping[str, np.ndarray], path: str, label: str, cases: int = 4) -> float:
    """Max |logit difference| between the graph and the numpy heads on `cases` random hiddens (scaled like a
    final-norm output); ExportError naming `label` when it exceeds TOLERANCE."""
    drafter = MedusaDrafter(weights)
    net = OnnxNet(path, threads=1, label=f"medusa graph {label}")
    rng = np.random.default_rng(0)
    H = drafter.out.shape[2]
    worst = 0.0
    for _ in range(cases):
        h = rng.standard_normal(H).astype(np.float32)
        got = net.run({"hidden": h})["logits"]
        want = drafter.head_logits(h, drafter.num_heads)
        worst = max(worst, float(np.max(np.abs(got - want))))
    if not worst <= TOLERANCE:  # NaN fails too
        raise ExportError(f"{label}: the Medusa heads' ONNX graph differs from the numpy heads by {worst:.2e} "
                          f"(max |logit difference|, allowed {TOLERANCE:.0e}); the bundle was left unchanged")
    return worst


def export_medusa_graphs(bundle, staging: str, precision: str, validate: bool = True) -> List[Tuple[str, str, Dict]]:
    """The bundle's Medusa drafters' graphs, written into `staging` (one per head file, shared by the drafters
    reading it) and checked. Returns (drafter name, graph path relative to the bundle, params) per drafter;
    the caller moves the files into onnx/ and records them. fp32 only: other precisions export none."""
    if precision != "fp32":
        return []
    out, done = [], {}
    for name, d in bundle.drafters.items():
        if d.kind != "medusa":
            continue
        src = d.files[0]
        if src not in done:
            weights = read_safetensors(bundle.path(src))
            stem = os.path.splitext(os.path.basename(os.path.dirname(src)) or "medusa")[0]
            rel = f"onnx/drafter.{stem}.fp32.onnx"
            staged = os.path.join(staging, os.path.basename(rel))
            export_medusa_onnx(weights, staged)
            err = check_medusa_onnx(weights, staged, f"{bundle.root}/{rel} (drafter {name})") if validate else None
            if err is not None:
                print(f"{bundle.root}/{rel}: max |logit diff| vs the numpy heads {err:.2e}")
            done[src] = rel
        out.append((name, done[src], {"precision": "fp32", "inputs": ["hidden"], "outputs": ["logits"]}))
    return out


def add_medusa_onnx(bundle_dir: str) -> List[str]:
    """Only the Medusa graphs, for a bundle whose target graph is already exported (`edgespec export --to onnx`
    does both): staged, checked, then moved into onnx/ and recorded. Returns the files written."""
    import shutil

    from runtime.model import bundle as bundle_mod
    b = bundle_mod.load(bundle_dir)
    writer = bundle_mod.BundleWriter.extend(bundle_dir)
    staging = tempfile.mkdtemp(prefix=".onnx-export-", dir=bundle_dir)
    try:
        graphs = export_medusa_graphs(b, staging, "fp32")
        os.makedirs(os.path.join(bundle_dir, "onnx"), exist_ok=True)
        files = sorted({f for _, rel, _ in graphs for f in (rel, rel + ".data")})
        for f in files:
            os.replace(os.path.join(staging, os.path.basename(f)), os.path.join(bundle_dir, f))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name, rel, params in graphs:
        writer.add_drafter_backend(name, "onnx", [rel, rel + ".data"], params)
    writer.write()
    return files
