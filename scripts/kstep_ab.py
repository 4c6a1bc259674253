"""K-step against step-wise draft chains, in one process, interleaved: tok/s over plain decoding, tau, draft and
verify ms per cycle, T = 0 and 1, fixed chains of 4 over the bench prompts; then one K = 4 run of each K-step graph
against one single-row draft step from the same cache state (issue 32's "a K = 4 chain costs <= 1.5x one step").
Drafters: draft_model, eagle / eagle3_chain (EAGLE chains), mtp (one module).

The bundle must hold K-step graphs (`edgespec export --to onnx --bundle B --kstep on`); two copies of it are made in
a temporary directory, one with params.kstep "on" for the named drafters, one with "off".

    PYTHONPATH=$PWD python scripts/kstep_ab.py B [draft_model,eagle3_chain,eagle,mtp] [rounds]
"""
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

from runtime.commands.bench import bench_prompts, with_shape
from runtime.config import RuntimeConfig
from runtime.model import bundle as bundle_io
from runtime.model.layers import causal_mask
from runtime.sampling import SamplingParams
from runtime.serving.session import GenerationParams, Session, prompt_format
from runtime.text.tokenizer import Tokenizer
from tests.support.kstep import set_kstep


def copy_with_mode(src: str, dst: str, names, mode: str) -> str:
    shutil.copytree(src, dst)
    set_kstep(dst, names, mode)
    return dst


def one_step_and_run(name: str, drafter, ids):
    """(seconds of one single-row draft step, of one K-step run), from the same cache state, greedy."""
    params = SamplingParams()
    zeros = np.zeros(drafter.kstep.steps)
    if name == "draft_model":
        m = drafter.model
        m.reset()
        m.forward(np.asarray(ids[:-1]), np.arange(len(ids) - 1))
        base = m.cache_len
        t0 = time.perf_counter()
        m.forward(np.asarray(ids[-1:]), np.arange(len(ids) - 1, len(ids)))
        one = time.perf_counter() - t0
        m.keep(base, [])
        t0 = time.perf_counter()
        drafter.kstep.run(ids[-1:], np.arange(len(ids) - 1, len(ids)), params, ids, zeros)
        return one, time.perf_counter() - t0
    feats = np.zeros((len(ids) - 1, drafter.spec.hidden_size), np.float32)
    if name == "mtp":  # one module: its cache caught up on all but the last row, then that row alone
        cache = drafter.modules[0].cache
        drafter.reset()
        drafter.modules[0].run(feats[:-1], ids[1:-1], 0)
        base = cache.length
        t0 = time.perf_counter()
        drafter.modules[0].run(feats[-1:], ids[-1:], len(ids) - 2)
        one = time.perf_counter() - t0
        cache.length = base
        t0 = time.perf_counter()
        drafter.kstep.run(cache, ids[-1:], feats[-1:], np.array([len(ids) - 2]), params, ids, zeros)
        run = time.perf_counter() - t0
        cache.length = base
        return one, run
    drafter.reset()
    drafter.pending = feats[:-1]
    drafter._catch_up(ids[:-1])
    base = drafter.cache.length
    t0 = time.perf_counter()
    drafter._step(feats[-1:], ids[-1:], np.array([len(ids) - 2]), causal_mask(base, 1), last_only=True)
    one = time.perf_counter() - t0
    drafter.cache.length = base
    t0 = time.perf_counter()
    drafter.kstep.run(drafter.cache, ids[-1:], feats[-1:], np.array([len(ids) - 2]), params, ids, zeros)
    run = time.perf_counter() - t0
    drafter.cache.length = base
    return one, run


def main(argv) -> None:
    src = argv[1]
    names = (argv[2] if len(argv) > 2 else "draft_model,eagle3_chain,eagle").split(",")
    rounds = int(argv[3]) if len(argv) > 3 else 2
    work = tempfile.mkdtemp(prefix="kstep-ab-")
    try:
        roots = {mode: copy_with_mode(src, os.path.join(work, mode), names, mode) for mode in ("on", "off")}
        b = bundle_io.load(roots["on"], verify_checksums=False)
        fmt = prompt_format(b, Tokenizer(b.path(b.tokenizer)))
        prompts = [p for d in ("planner", "action", "text") for p in bench_prompts(fmt, [d])[d]]
        sessions = {(n, tag): Session(with_shape(replace(RuntimeConfig(), bundle=roots[mode]), n + "@k4", n))
                    for n in names for tag, mode in (("kstep", "on"), ("stepwise", "off"))}
        sessions[("none", "")] = Session(with_shape(replace(RuntimeConfig(), bundle=roots["off"]), "none", "none"))
        for s in sessions.values():
            s.warm_up()
        labels = list(sessions)
        stats = {(label, t): [] for label in labels for t in (0.0, 1.0)}
        for r in range(rounds):
            for t in (0.0, 1.0):
                for i, p in enumerate(prompts):
                    k = (r * len(prompts) + i) % len(labels)  # rotated, so no configuration always runs first
                    for label in labels[k:] + labels[:k]:
                        out = sessions[label].generate(p, GenerationParams(max_tokens=48, temperature=t, seed=1000 * r + i))
                        stats[label, t].append(out.stats)
        print("| T | drafter | path | tok/s | over plain | tau | draft ms / cycle | verify ms / cycle |")
        print("|---|---|---|---|---|---|---|---|")
        for t in (0.0, 1.0):
            plain = stats[("none", ""), t]
            base = sum(x.tokens for x in plain) / sum(x.wall_s for x in plain)
            for label in labels:
                st = stats[label, t]
                cycles = sum(x.cycles for x in st)
                tps = sum(x.tokens for x in st) / sum(x.wall_s for x in st)
                print(f"| {t:.0f} | {label[0]} | {label[1] or '-'} | {tps:.0f} | {tps / base:.2f}x | "
                      f"{np.mean([x.tau for x in st]):.2f} | {1e3 * sum(x.draft_s for x in st) / cycles:.2f} | "
                      f"{1e3 * sum(x.verify_s for x in st) / cycles:.2f} |")
        ids = sessions[(names[0], "kstep")].tokenizer.encode(prompts[0])
        for n in names:
            pairs = [one_step_and_run(n, sessions[(n, "kstep")].drafter, ids) for _ in range(40)]
            one, run = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
            print(f"{n}: one draft step {1e3 * one:.3f} ms, one K = 4 run {1e3 * run:.3f} ms = {run / one:.2f}x a step "
                  "(greedy, medians of 40)")
        for s in sessions.values():
            s.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
