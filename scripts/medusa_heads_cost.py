"""Per-cycle drafting cost of Medusa heads: numpy vs the bundle's ONNX graph (1 and 2 ORT threads), interleaved.

    PYTHONPATH=. python scripts/medusa_heads_cost.py build/bundles/zoo build/bundles/standin-medusa

For each bundle: ROUNDS rounds, each timing CALLS head evaluations (all heads, one hidden) per configuration,
configurations rotated per round; prints the median ms per call [min-max] over rounds, wall and process CPU."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from runtime.model import bundle as bundle_io
from runtime.backends.onnx_net import OnnxNet
from runtime.drafters.medusa import MedusaDrafter
from runtime.model.tensors import read_safetensors

ROUNDS, CALLS = 7, 40


def main(paths) -> int:
    for path in paths:
        b = bundle_io.load(path, verify_checksums=False)
        entry = b.drafter("medusa")
        weights = read_safetensors(b.path(entry.files[0]))
        graph = b.path(entry.backends["onnx"].files[0])
        heads = {"numpy": MedusaDrafter(weights),
                 "onnx 1 thread": MedusaDrafter(weights, net=OnnxNet(graph, threads=1)),
                 "onnx 2 threads": MedusaDrafter(weights, net=OnnxNet(graph, threads=2))}
        h = np.random.default_rng(0).standard_normal(b.target.spec.hidden_size).astype(np.float32)
        wall = {k: [] for k in heads}
        cpu = {k: [] for k in heads}
        names = list(heads)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                d = heads[name]
                d.head_logits(h, d.num_heads)
                t, c = time.perf_counter(), time.process_time()
                for _ in range(CALLS):
                    d.head_logits(h, d.num_heads)
                wall[name].append((time.perf_counter() - t) / CALLS * 1e3)
                cpu[name].append((time.process_time() - c) / CALLS * 1e3)
        d = heads["numpy"]
        print(f"{b.name}: {d.num_heads} heads, hidden {d.out.shape[2]}, vocab {d.out.shape[1]}, "
              f"{d.memory_bytes / 2**20:.1f} MiB fp32")
        for name in names:
            w, c = wall[name], cpu[name]
            print(f"  {name:15s} wall {statistics.median(w):7.2f} ms [{min(w):.2f}-{max(w):.2f}]   "
                  f"cpu {statistics.median(c):7.2f} ms [{min(c):.2f}-{max(c):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["build/bundles/zoo"]))
