"""Benchmark a bundle's target backend (runs on the robot: numpy + onnxruntime, no torch).

    python -m runtime.commands.bench_backend --bundle build/bundles/zoo [--backend onnx] [--threads N]
    python -m runtime.commands.bench_backend --bundle OLD NEW --threads 1 2 --spinning run never   # configurations side by side

Prints, in the roofline habit:
  * measured memory bandwidth (a numpy copy of a >= 512 MB array: bytes read + bytes written / time)
  * time per forward for 1/2/4/8/16 new tokens at context 64/512/2048, every shape timed once per round
    in a random order (interleaved), median [min-max] of --repeats rounds, with a 1-token control cell
  * verify(k) / a 1-token step at each context, as the ratio within each round
  * step time vs context (1 new token): it must stay flat apart from attention
  * plain greedy decode tokens/s vs the bound bandwidth / weight bytes, as a percentage
  * Python overhead per cycle (time outside the backend's kernel call) as a share of the cycle
Several bundles / thread counts / spinning settings are configurations A, B, ... opened in ONE process and
interleaved in every round (forwards and decode runs alike), with each one's ratio to A per round; the
bandwidth is measured again in every decode round, so "% of bound" has a spread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

from runtime.model import bundle as bundle_mod
from runtime.backends.factory import open_model
from runtime.backends.numpy_ref import cache_shape
from runtime.config import BackendConfig
from runtime.errors import EdgespecError
from runtime.memory.kv import KVArena

PROMPT = 64  # prompt tokens before the plain-decode measurement


# "wall": elapsed time. "cpu": CPU seconds of this process (all its threads): on a time-sliced shared machine
# it leaves out the time other processes held the cores, so it measures the work, not the queue (with one
# intra-op thread and no spinning it equals wall time on an idle machine).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, clock=time.perf_counter) -> float:
    """Streaming bandwidth in bytes/s: the best of `repeats` copies of an nbytes array (read + write)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src), clock) for _ in range(repeats))
    return 2 * nbytes / best


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 3, clock=time.perf_counter) -> float:
    """Bytes/s a matrix-vector product reads: the best of `repeats` numpy float32 GEMVs over an nbytes matrix
    (what a decode step does with its weights; a read-only stream, unlike the copy of measure_bandwidth)."""
    w = np.ones((4096, nbytes // 4 // 4096), np.float32)
    x = np.ones(w.shape[1], np.float32)
    w @ x  # fault the pages in
    return nbytes / min(_timed(lambda: w @ x, clock) for _ in range(repeats))


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def open_target(b: bundle_mod.Bundle, backend: str, positions: int, threads: int, profile_prefix: str = "",
                precision: str = "auto", spinning: str = "never"):
    """The bundle's target on `backend` (onnx: its graph of `precision`) with a fresh arena for `positions` rows,
    opened as a Session opens it (runtime/backends/factory.open_model)."""
    spec = b.target.spec
    files = b.onnx_target(precision) if backend == "onnx" else b.target_files(b.target_entry_key(backend, precision))
    dtype = np.float16 if files.params.get("precision") == "fp16" else np.float32
    cache = KVArena.for_context({"target": cache_shape(spec)}, positions, dtype).allocate("target", cache_shape(spec), positions)
    return open_model(b, spec, files, BackendConfig(kind=backend, threads=threads), cache, profile_prefix=profile_prefix,
                      spinning=spinning)


def time_one(target, context: int, t: int, rng: np.random.Generator, clock=time.perf_counter) -> float:
    """Seconds of one forward of t new tokens (causal) on a cache holding `context` rows. The rows'
    contents do not matter for timing, so the cache length is set directly and rolled back."""
    target.keep(0, [])
    target.cache.length = context
    tokens = rng.integers(0, target.spec.vocab_size, t)
    return _timed(lambda: target.forward(tokens, np.arange(context, context + t)), clock)


CONTROL = "1 (control)"  # a second 1-token cell per context: its ratio to the first shows the noise floor


def interleaved_grid(targets: Sequence, contexts: Sequence[int], news: Sequence[int], rounds: int,
                     rng: np.random.Generator, clock=time.perf_counter, settle: int = 0) -> Dict[Tuple, List[float]]:
    """One forward per cell (configuration x new tokens x context, plus a CONTROL 1-token cell per
    configuration and context), every cell once per round in a fresh random order, so that load on shared
    cores hits all shapes and configurations alike (timing one shape after another let a busy minute land
    on one shape). A first round warms each shape up and is dropped. `settle`: untimed forwards of the cell's
    own shape just before its timed one, so that it is timed as a step after a step of its shape (a shape
    switch rebinds the backend's buffers and re-plans ONNX Runtime's memory: on the zoo it added ~0.1 ms to a
    1-row forward, ~10 %, and nothing measurable to 4-16 rows).
    Returns {(configuration index, t, context): [seconds per round]}."""
    cells = [(j, t, c) for j in range(len(targets)) for t in list(news) + [CONTROL] for c in contexts]
    times: Dict[Tuple, List[float]] = {cell: [] for cell in cells}
    for r in range(rounds + 1):
        for i in rng.permutation(len(cells)):
            j, t, c = cells[i]
            for _ in range(settle if r else 0):
                time_one(targets[j], c, 1 if t == CONTROL else t, rng, clock)
            s = time_one(targets[j], c, 1 if t == CONTROL else t, rng, clock)
            if r:
                times[cells[i]].append(s)
    return times


def _spread(xs: Sequence[float], fmt: str) -> str:
    """'median [min-max]' of xs, each formatted with fmt."""
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def profile_ops(bundle_dir: str, context: int, t: int, steps: int, threads: int, prefix: str,
                precision: str = "auto", spinning: str = "never") -> List[str]:
    """Run `steps` forwards of t new tokens at `context` under ONNX Runtime's profiler and summarise its
    JSON trace: milliseconds per step by op type (kernel time, summed over nodes), largest first."""
    import json
    from collections import defaultdict

    b = bundle_mod.load(bundle_dir, verify_checksums=False)
    target = open_target(b, "onnx", context + t + 1, threads, profile_prefix=prefix, precision=precision,
                         spinning=spinning)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        time_one(target, context, t, rng)
    path = target.session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    per_op: Dict[str, float] = defaultdict(float)
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            per_op[e["args"].get("op_name", "?")] += e["dur"]
    run_ms = statistics.median(runs) / 1e3 if runs else float("nan")
    total = sum(per_op.values())
    lines = [f"ORT profile ({path}): {t} new tokens at ctx {context}, {steps} runs; model_run median {run_ms:.2f} ms",
             "op type | ms per run | share of kernel time"]
    for op, us in sorted(per_op.items(), key=lambda kv: -kv[1]):
        lines.append(f"{op} | {us / 1e3 / steps:.2f} | {100 * us / total:.1f}%")
    return lines


def decode_loop(target, prompt: np.ndarray, n: int, clock=time.perf_counter):
    """Plain greedy decoding of n tokens. Returns (seconds, seconds inside the backend's kernel call)."""
    target.reset()
    logits = target.forward(prompt, np.arange(len(prompt))).logits[-1]
    tok, pos, kernel = int(np.argmax(logits)), len(prompt), 0.0
    start = clock()
    for _ in range(n):
        logits = target.forward(np.array([tok]), np.array([pos])).logits[0]
        kernel += getattr(target, "last_run_s", 0.0)
        tok, pos = int(np.argmax(logits)), pos + 1
    return clock() - start, kernel


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


def run(bundle_dirs: Sequence[str], backend: str, threads: Sequence[int], contexts: Sequence[int],
        news: Sequence[int], repeats: int, decode_tokens: int, precision: str = "auto",
        spinning: Sequence[str] = ("never",), decode_rounds: int = 3, clock: str = "wall") -> List[str]:
    """The tables for every configuration (bundle x threads x spinning), interleaved in one process."""
    rows = max(max(contexts) + max(news), PROMPT + decode_tokens) + 1
    configs, targets, lines = [], [], []
    for d in bundle_dirs:
        b = bundle_mod.load(d, verify_checksums=False)
        for th in threads:
            for spin in spinning:
                label = chr(ord("A") + len(configs))
                target = open_target(b, backend, rows, th, precision=precision, spinning=spin)
                configs.append(label)
                targets.append(target)
                spec = b.target.spec
                lines.append(f"{label}: bundle {d} ({b.name}: {spec.family}, {spec.num_layers} layers, hidden "
                             f"{spec.hidden_size}, vocab {spec.vocab_size}); backend {backend} ({precision}), threads "
                             f"{getattr(target, 'threads', 'numpy')}, spinning {spin}, weights "
                             f"{target.weight_bytes / 1e6:.1f} MB")
    rng = np.random.default_rng(0)
    tick = CLOCKS[clock]
    bw = measure_bandwidth(clock=tick)
    lines.append(f"measured bandwidth {bw / 1e9:.1f} GB/s (numpy copy, 512 MB); times are {clock} clock")
    news = [1] + [t for t in news if t != 1]
    times = interleaved_grid(targets, contexts, news, repeats, rng, tick)
    head = f"{'new tokens':>12s} | " + " | ".join(f"{'ctx %d' % c:>24s}" for c in contexts)
    for j, label in enumerate(configs):
        lines += ["", f"[{label}] ms per forward, median [min-max] of {repeats} interleaved rounds (every shape "
                      "once per round, random order)", head]
        for t in news + [CONTROL]:
            lines.append(f"{t:>12} | " + " | ".join(f"{_spread([1e3 * x for x in times[j, t, c]], '{:.2f}'):>24s}"
                                                    for c in contexts))
        lines += ["", f"[{label}] verify cost / a 1-token step at the same context (ratio within each round, "
                      "median [min-max]); the control row is 1 token vs 1 token", head]
        for t in news[1:] + [CONTROL]:
            lines.append(f"{t:>12} | " + " | ".join(
                f"{_spread([x / y for x, y in zip(times[j, t, c], times[j, 1, c])], '{:.2f}x'):>24s}" for c in contexts))
        steps = [statistics.median(times[j, 1, c]) for c in contexts]
        lines += ["", f"[{label}] step time vs context (1 new token): " +
                  "  ".join(f"{c}: {1e3 * s:.2f} ms" for c, s in zip(contexts, steps)) +
                  f"  (x{steps[-1] / steps[0]:.2f} from {contexts[0]} to {contexts[-1]})"]
        if j:
            lines += ["", f"[{label}] time / [A] time for the same shape (ratio within each round, median [min-max])", head]
            for t in news:
                lines.append(f"{t:>12} | " + " | ".join(
                    f"{_spread([x / y for x, y in zip(times[j, t, c], times[0, t, c])], '{:.2f}x'):>24s}"
                    for c in contexts))
    # Plain decode, every configuration once per round in a random order, the bandwidth measured in each round.
    n, vocab = decode_tokens, targets[0].spec.vocab_size
    tps: Dict[int, List[float]] = {j: [] for j in range(len(targets))}
    bound: Dict[int, List[float]] = {j: [] for j in range(len(targets))}
    read_bound: Dict[int, List[float]] = {j: [] for j in range(len(targets))}
    kernel: Dict[int, float] = {}
    prompt = rng.integers(0, vocab, PROMPT)
    for _ in range(decode_rounds):
        bw_round = measure_bandwidth(repeats=3, clock=tick)
        read_round = measure_read_bandwidth(clock=tick)
        for j in rng.permutation(len(targets)):
            secs, kernel[j] = decode_loop(targets[j], prompt, n, tick)
            tps[j].append(n / secs)
            bound[j].append(bw_round / targets[j].weight_bytes)
            read_bound[j].append(read_round / targets[j].weight_bytes)
    lines += ["", f"plain greedy decode ({n} tokens after a {PROMPT}-token prompt), {decode_rounds} interleaved rounds, "
                  "the bandwidth measured again in each round; median [min-max]"]
    for j, label in enumerate(configs):
        wbytes = targets[j].weight_bytes
        pct = [100 * x / y for x, y in zip(tps[j], bound[j])]
        read_pct = [100 * x / y for x, y in zip(tps[j], read_bound[j])]
        lines.append(f"[{label}] {_spread(tps[j], '{:.1f}')} tok/s; bound {_spread(bound[j], '{:.1f}')} tok/s "
                     f"(bandwidth / weight bytes) -> {_spread(pct, '{:.0f}')}% of bound; achieved "
                     f"{statistics.median(tps[j]) * wbytes / 1e9:.1f} GB/s; {_spread(read_pct, '{:.0f}')}% of what a numpy "
                     f"float32 GEMV reads ({statistics.median(read_bound[j]) * wbytes / 1e9:.1f} GB/s)")
        if kernel.get(j) and clock == "wall":  # the kernel time is wall time
            secs = n / tps[j][-1]
            lines.append(f"[{label}] python overhead per decode step: {1e6 * (secs - kernel[j]) / n:.0f} us "
                         f"= {100 * (1 - kernel[j] / secs):.1f}% of the step (last round)")
            ctx, nodes = min(512, max(contexts)), min(8, max(news))
            cyc, share = verify_cycle_overhead(targets[j], ctx, nodes, 20, rng)
            lines.append(f"[{label}] python overhead per verify cycle ({nodes}-node tree at ctx {ctx}, forward + keep): "
                         f"{1e6 * cyc * share:.0f} us = {100 * share:.1f}% of a {1e3 * cyc:.2f} ms cycle")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.commands.bench_backend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, nargs="+",
                    help="bundle directory (e.g. build/bundles/zoo); several: their targets side by side")
    ap.add_argument("--backend", default="onnx", choices=("onnx", "numpy_ref", "tensorrt"))
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16", "int8", "int4"),
                    help="onnx: which target graph of the bundle (auto = its float graph)")
    ap.add_argument("--threads", type=int, nargs="+", default=[0],
                    help="intra-op threads (0 = core count); several: one configuration each")
    ap.add_argument("--spinning", nargs="+", choices=("never", "run", "always"), default=["never"],
                    help="onnx: ORT's pool threads never spin (never, edgespec's default), spin during a run only (run) "
                         "or also between runs (always, ORT's default); several: one configuration each")
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=10, help="interleaved rounds")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=3, help="interleaved rounds of the plain-decode measurement")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall (elapsed) or cpu (this process's CPU seconds, all threads: what the work costs on a "
                         "time-sliced shared machine; meaningless with --spinning always)")
    ap.add_argument("--profile", metavar="PREFIX", default="",
                    help="instead of the tables: run ONNX Runtime's profiler (trace written to PREFIX_<date>.json) "
                         "over --repeats forwards of each --new-tokens at each --contexts and print ms per op type")
    a = ap.parse_args(argv)
    try:
        return _main(a)
    except EdgespecError as exc:
        print(f"python -m runtime.commands.bench_backend: error: {exc}", file=sys.stderr)
        return 2


def _main(a: argparse.Namespace) -> int:
    if a.profile:
        for d in a.bundle:
            for c in a.contexts:
                for t in a.new_tokens:
                    for line in profile_ops(d, c, t, a.repeats, a.threads[0], a.profile, a.precision, a.spinning[0]):
                        print(line, flush=True)
        return 0
    for line in run(a.bundle, a.backend, a.threads, a.contexts, a.new_tokens, a.repeats, a.decode_tokens, a.precision,
                    list(a.spinning), a.decode_rounds, a.clock):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
