"""Benchmark a bundle's target backend (runs on the robot: numpy + onnxruntime, no torch).

    python -m runtime.bench_backend --bundle build/bundles/zoo [--backend onnx] [--threads N]

Prints, in the roofline habit:
  * measured memory bandwidth (a numpy copy of a >= 512 MB array: bytes read + bytes written / time)
  * time per forward for 1/4/8/16 new tokens at context 64/512/2048 (median of --repeats)
  * step time vs context (1 new token): it must stay flat apart from attention
  * plain greedy decode tokens/s vs the bound bandwidth / weight bytes, as a percentage
  * Python overhead per cycle (time outside the backend's kernel call) as a share of the cycle
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import List, Sequence

import numpy as np

from runtime import bundle as bundle_mod
from runtime.backends.numpy_ref import NumpyTarget, cache_shape
from runtime.kv import KVArena
from runtime.tensors import read_safetensors

PROMPT = 64  # prompt tokens before the plain-decode measurement


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Streaming bandwidth in bytes/s: the best of `repeats` copies of an nbytes array (read + write)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def open_target(b: bundle_mod.Bundle, backend: str, positions: int, threads: int):
    """The bundle's target on `backend` with a fresh arena for `positions` rows."""
    spec = b.target.spec
    if backend == "onnx":
        from runtime.backends.onnx import OnnxTarget

        files = b.target_files("onnx")
        dtype = np.float16 if files.params.get("precision") == "fp16" else np.float32
        cache = KVArena.for_context({"target": cache_shape(spec)}, positions, dtype).allocate("target", cache_shape(spec), positions)
        model = next(f for f in files.files if f.endswith(".onnx"))
        return OnnxTarget(spec, b.path(model), cache, threads=threads, tap_names=files.params.get("taps", ()))
    if backend == "tensorrt":
        from runtime.backends.factory import open_model
        from runtime.config import BackendConfig

        files = b.target_files("tensorrt")
        dtype = np.float16 if files.params.get("precision") == "fp16" else np.float32
        cache = KVArena.for_context({"target": cache_shape(spec)}, positions, dtype).allocate("target", cache_shape(spec), positions)
        return open_model(b, spec, files, BackendConfig(kind="tensorrt"), cache)
    weights = {}
    for rel in b.target_files("numpy_ref").files:
        if rel.endswith(".safetensors"):
            weights.update(read_safetensors(b.path(rel)))
    cache = KVArena.for_context({"target": cache_shape(spec)}, positions).allocate("target", cache_shape(spec), positions)
    return NumpyTarget(spec, weights, cache)


def time_forward(target, context: int, t: int, repeats: int, rng: np.random.Generator) -> float:
    """Median seconds of one forward of t new tokens (causal) on a cache holding `context` rows.
    The rows' contents do not matter for timing, so the cache length is set directly and rolled back."""
    times = []
    for _ in range(repeats + 1):
        target.keep(0, [])
        target.cache.length = context
        tokens = rng.integers(0, target.spec.vocab_size, t)
        times.append(_timed(lambda: target.forward(tokens, np.arange(context, context + t))))
    return statistics.median(times[1:])  # the first call warms up this shape


def decode_loop(target, prompt: np.ndarray, n: int):
    """Plain greedy decoding of n tokens. Returns (seconds, seconds inside the backend's kernel call)."""
    target.reset()
    logits = target.forward(prompt, np.arange(len(prompt))).logits[-1]
    tok, pos, kernel = int(np.argmax(logits)), len(prompt), 0.0
    start = time.perf_counter()
    for _ in range(n):
        logits = target.forward(np.array([tok]), np.array([pos])).logits[0]
        kernel += getattr(target, "last_run_s", 0.0)
        tok, pos = int(np.argmax(logits)), pos + 1
    return time.perf_counter() - start, kernel


def verify_cycle_overhead(target, context: int, t: int, cycles: int, rng: np.random.Generator):
    """A verify cycle as the engine runs it: a tree-masked forward of t nodes, then keep() of half of
    them. Returns (mean cycle seconds, share outside the kernel call)."""
    target.keep(0, [])
    target.cache.length = context
    mask = np.concatenate([np.ones((t, context), bool), np.tril(np.ones((t, t), bool))], axis=1)
    total = kernel = 0.0
    for _ in range(cycles):
        tokens = rng.integers(0, target.spec.vocab_size, t)
        start = time.perf_counter()
        target.forward(tokens, np.arange(context, context + t), mask)
        target.keep(context, list(range(context, context + t, 2)))
        total += time.perf_counter() - start
        kernel += getattr(target, "last_run_s", 0.0)
        target.keep(context, [])
    return total / cycles, 1 - kernel / total


def run(bundle_dir: str, backend: str, threads: int, contexts: Sequence[int], news: Sequence[int],
        repeats: int, decode_tokens: int) -> List[str]:
    b = bundle_mod.load(bundle_dir, verify_checksums=False)
    rows = max(max(contexts) + max(news), PROMPT + decode_tokens) + 1
    target = open_target(b, backend, rows, threads)
    rng = np.random.default_rng(0)
    bw = measure_bandwidth()
    wbytes = target.weight_bytes
    lines = [f"bundle {b.name}: {b.target.spec.family}, {b.target.spec.num_layers} layers, hidden {b.target.spec.hidden_size}, "
             f"vocab {b.target.spec.vocab_size}; backend {backend}, threads {getattr(target, 'threads', 'numpy')}",
             f"weights {wbytes / 1e6:.1f} MB; measured bandwidth {bw / 1e9:.1f} GB/s (numpy copy, 512 MB)",
             "", "ms per forward (median of %d)" % repeats,
             "new tokens | " + " | ".join(f"ctx {c:>5d}" for c in contexts)]
    grid = {}
    for t in news:
        row = [time_forward(target, c, t, repeats, rng) for c in contexts]
        grid[t] = row
        lines.append(f"{t:>10d} | " + " | ".join(f"{1e3 * s:9.2f}" for s in row))
    base = grid[news[0]][0]
    lines += ["", "relative to %d token at ctx %d:" % (news[0], contexts[0])]
    for t in news:
        lines.append(f"{t:>10d} | " + " | ".join(f"{s / base:8.2f}x" for s in grid[t]))
    sweep = sorted({c for c in (64, 128, 256, 512, 1024, 2048, 4096) if c <= max(contexts)} | set(contexts))
    steps = [time_forward(target, c, 1, repeats, rng) for c in sweep]
    lines += ["", "step time vs context (1 new token): " +
              "  ".join(f"{c}: {1e3 * s:.2f} ms" for c, s in zip(sweep, steps)) +
              f"  (x{steps[-1] / steps[0]:.2f} from {sweep[0]} to {sweep[-1]})"]
    n = decode_tokens
    secs, kernel = decode_loop(target, rng.integers(0, b.target.spec.vocab_size, PROMPT), n)
    tps, bound = n / secs, bw / wbytes
    lines += ["", f"plain greedy decode ({n} tokens after a {PROMPT}-token prompt): {tps:.1f} tok/s; "
                  f"bound {bound:.1f} tok/s (bandwidth / weight bytes) -> {100 * tps / bound:.0f}% of bound; "
                  f"achieved {tps * wbytes / 1e9:.1f} GB/s"]
    if kernel:
        lines.append(f"python overhead per decode step: {1e6 * (secs - kernel) / n:.0f} us "
                     f"= {100 * (1 - kernel / secs):.1f}% of the step")
        ctx, nodes = min(512, max(contexts)), min(8, max(news))
        cyc, share = verify_cycle_overhead(target, ctx, nodes, 20, rng)
        lines.append(f"python overhead per verify cycle ({nodes}-node tree at ctx {ctx}, forward + keep): "
                     f"{1e6 * cyc * share:.0f} us = {100 * share:.1f}% of a {1e3 * cyc:.2f} ms cycle")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.bench_backend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (e.g. build/bundles/zoo)")
    ap.add_argument("--backend", default="onnx", choices=("onnx", "numpy_ref", "tensorrt"))
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = core count)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--decode-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    for line in run(a.bundle, a.backend, a.threads, a.contexts, a.new_tokens, a.repeats, a.decode_tokens):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
