"""The GPU check behind scripts/gpu_check.sh: on a machine with an NVIDIA GPU, run what that machine allows of
edgespec's GPU paths and print one summary table.

  ONNX Runtime, CUDA execution provider (always, once onnxruntime-gpu imports):
    equivalence of the fp16 graphs against the numpy reference (prefill, decode, a tree verify, keep),
    greedy identity and speed (`edgespec bench`: the draft model, EAGLE-3 chain and MTP module through their K-step
    graphs, the fused draft loop, with the runs per path), a short `edgespec certify` (the draft model at T = 1:
    its K-step graph's in-graph sampling against the target's law);
  TensorRT (when its bindings and cuda-python import): engines built (`edgespec export --to tensorrt`), the same
    equivalence (eager and with CUDA graphs), bench and certify, bench again with CUDA graphs, and the forward cost
    by new tokens x context (`python -m runtime.commands.bench_backend`);
  torch CUDA (when torch sees the GPU): a short `edgespec train-drafter eagle3 --device cuda` on the zoo target
    (bf16 target, autocast, the feature cache, held-out evaluation), ~1 minute.

It works on a copy of the zoo bundle under --work, never on build/bundles. Nothing is downloaded unless pip can
reach an index (tried once, with a 5 s timeout); whatever is missing is named in the table as SKIPPED, with the
reason. Without a GPU it prints one SKIPPED line and exits 0 (that is what runs in the test suite). Every step has a
timeout and the whole check stops starting steps after --budget-s seconds (default 540: it fits in 10 minutes)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "runtime.cli"]
FP16_TOL = 2e-2  # max relative error of fp16 graphs / engines against the float32 numpy reference


def gpu_name() -> Optional[str]:
    """The first GPU nvidia-smi lists, or None (no driver, no device)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def probe() -> Dict[str, object]:
    """What this machine has: the GPU, and which of the packages each path needs import."""
    facts: Dict[str, object] = {"gpu": gpu_name(), "python": sys.version.split()[0]}
    for mod in ("numpy", "yaml", "tokenizers", "torch", "onnx", "onnxscript", "onnxruntime", "tensorrt"):
        try:
            m = importlib.import_module(mod)
            facts[mod] = getattr(m, "__version__", "yes")
        except Exception as exc:  # a broken install is as missing as an absent one
            facts[mod] = None
            facts[f"{mod}_error"] = f"{exc.__class__.__name__}: {exc}"[:160]
    try:
        from runtime.backends.tensorrt import import_cudart
        import_cudart()
        facts["cuda-python"] = "yes"
    except Exception:
        facts["cuda-python"] = None
    if facts["torch"]:
        import torch
        facts["torch_cuda"] = torch.cuda.is_available()
    if facts["onnxruntime"]:
        import onnxruntime
        facts["ort_providers"] = onnxruntime.get_available_providers()
    return facts


def try_pip(packages: List[str]) -> str:
    """One quick attempt to install `packages` (offline machines fail fast); returns what happened."""
    if not packages:
        return "nothing to install"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--timeout", "5", "--retries", "0", *packages]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return f"pip install {' '.join(packages)}: timed out"
    if out.returncode == 0:
        return f"installed {' '.join(packages)}"
    return f"pip install {' '.join(packages)} failed (no index reachable?): {out.stderr.strip().splitlines()[-1:]}"


def plan(facts: Dict[str, object]) -> List[Tuple[str, str, Optional[str]]]:
    """(check, backend, reason it is skipped or None) for every check, in order."""
    base = [m for m in ("numpy", "yaml", "tokenizers") if not facts.get(m)]
    export = [m for m in ("torch", "onnx", "onnxscript") if not facts.get(m)]
    cuda_ep = "CUDAExecutionProvider" in (facts.get("ort_providers") or [])
    trt = bool(facts.get("tensorrt")) and bool(facts.get("cuda-python"))
    rows = []
    for check in ("fp16 ONNX export", "equivalence vs numpy", "greedy identity + bench", "certify"):
        why = None
        if base:
            why = f"the runtime's packages are missing: {', '.join(base)}"
        elif export and check == "fp16 ONNX export":
            why = f"the export needs {', '.join(export)} (not installed)"
        elif not cuda_ep and check != "fp16 ONNX export":
            why = ("onnxruntime-gpu is not installed (onnxruntime: "
                   f"{facts.get('onnxruntime') or 'missing'}, providers {facts.get('ort_providers') or []})")
        rows.append((check, "onnx CUDA EP", why))
    for check in ("engine build", "equivalence vs numpy", "equivalence, CUDA graphs", "greedy identity + bench",
                  "bench with CUDA graphs", "certify", "forward cost by T x ctx"):
        why = None
        if not facts.get("tensorrt"):
            why = "TensorRT's Python bindings are not importable (" + str(facts.get("tensorrt_error", "missing")) + ")"
        elif not trt:
            why = "cuda-python is not installed"
        rows.append((check, "tensorrt", why))
    why = None
    if not facts.get("torch"):
        why = "torch is not installed (train-drafter needs it)"
    elif not facts.get("torch_cuda"):
        why = f"torch {facts['torch']} sees no CUDA device (a CPU-only build?)"
    rows.append(("train-drafter, feature cache", "torch CUDA", why))
    return rows


def run(cmd: List[str], timeout: float, env: Optional[dict] = None) -> Tuple[int, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=ROOT,
                             env={**os.environ, **(env or {})})
        return out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout:.0f} s: {(exc.stdout or b'')[-300:]!r}"


def equivalence(bundle: str, backend: str, config: str) -> Tuple[bool, str]:
    """Target logits of the bundle on `backend` against the numpy reference: prefill, decode, a 4-node tree
    verify, then keep() of a path and one more decode. Returns (within FP16_TOL, detail)."""
    import numpy as np

    from runtime.model import bundle as bundle_mod
    from runtime.backends.factory import load_weights, open_model
    from runtime.backends.numpy_ref import NumpyTarget, cache_shape
    from runtime.config import load_config
    from runtime.memory.kv import KVArena

    b = bundle_mod.load(bundle)
    spec, cfg = b.target.spec, load_config(config)
    shape, rows = cache_shape(spec), 256
    dtype = np.float16 if b.target.backends[backend].params.get("precision") == "fp16" else np.float32
    model = open_model(b, spec, b.target.backends[backend], cfg.backend, KVArena.for_context({"t": shape}, rows, dtype)
                       .allocate("t", shape, rows))
    ref = NumpyTarget(spec, load_weights(b, b.target.backends["numpy_ref"].files),
                      KVArena.for_context({"t": shape}, rows).allocate("t", shape, rows))
    rng = np.random.default_rng(0)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    worst = 0.0
    for step in ("prefill", "decode", "tree", "after keep"):
        p = model.cache_len
        if step == "prefill":
            toks, pos, mask = rng.integers(0, spec.vocab_size, 40), np.arange(40), None
        elif step == "tree":
            toks, pos = rng.integers(0, spec.vocab_size, 4), np.array([p, p + 1, p + 1, p + 2])
            mask = np.concatenate([np.ones((4, p), bool), tree], axis=1)
        else:
            toks, pos, mask = rng.integers(0, spec.vocab_size, 1), np.array([p]), None
        a, r = model.forward(toks, pos, mask).logits, ref.forward(toks, pos, mask).logits
        worst = max(worst, float(np.abs(a - r).max() / np.abs(r).max()))
        if step == "tree":
            model.keep(p, [p, p + 1, p + 3])
            ref.keep(p, [p, p + 1, p + 3])
    return worst <= FP16_TOL, f"max rel err {worst:.1e} (tolerance {FP16_TOL:.0e}) over prefill, decode, tree, keep"


def bench_summary(output: str) -> Tuple[bool, str]:
    rows = json.loads(output[output.index("["):output.rindex("]") + 1])
    ident = all(r.get("identical_to_plain") is not False for r in rows)
    parts = [f"{r['label']} {r['tokens_per_s']:.0f} tok/s {r['speedup']:.2f}x tau {r['tau']:.2f}"
             + (f" (K-step runs {r['draft_paths'].get('kstep', 0)}, step-wise {r['draft_paths'].get('stepwise', 0)})"
                if r.get("draft_paths") else "") for r in rows]
    return ident, ("greedy identical; " if ident else "greedy NOT identical; ") + ", ".join(parts)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "gpu_check"), help="scratch directory (bundle copy)")
    ap.add_argument("--bundle", default=os.path.join(ROOT, "build", "bundles", "zoo"), help="bundle to copy")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting checks after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (what would run, what is skipped), run nothing")
    ap.add_argument("--no-install", action="store_true", help="do not try pip for missing packages")
    args = ap.parse_args(argv)
    start = time.time()
    facts = probe()
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in facts.items() if not k.endswith("_error")))
    if not facts["gpu"] and not args.dry_run:
        print("gpu_check: SKIPPED: no NVIDIA GPU here (nvidia-smi lists no device); nothing to check")
        return 0
    if not args.dry_run and not args.no_install:
        missing = [m for m in ("tokenizers", "pyyaml", "onnxscript") if not facts.get("yaml" if m == "pyyaml" else m)]
        if "CUDAExecutionProvider" not in (facts.get("ort_providers") or []):
            missing.append("onnxruntime-gpu")
        if missing:
            print(f"gpu_check: {try_pip(missing)}")
            importlib.invalidate_caches()
            facts = probe()
    steps = plan(facts)
    if args.dry_run:
        for check, backend, why in steps:
            print(f"  {backend:13s} {check:26s} " + (f"SKIPPED: {why}" if why else "would run"))
        for cmd in commands("WORK/zoo"):
            print("  $ edgespec " + " ".join(cmd))
        return 0
    results = execute(steps, args, start)
    print(f"\n{'backend':13s} {'check':26s} {'result':8s} {'s':>5s}  detail")
    for backend, check, result, secs, detail in results:
        print(f"{backend:13s} {check:26s} {result:8s} {secs:5.0f}  {detail}")
    print(f"gpu_check: {facts['gpu']}; {time.time() - start:.0f} s in all")
    return 1 if any(r[2] == "FAIL" for r in results) else 0


def commands(bundle: str) -> List[List[str]]:
    """The edgespec command lines the check runs, in order (listed by --dry-run; a test parses each)."""
    jetson, trt = "configs/runtime_jetson.yaml", "configs/runtime_tensorrt.yaml"
    bench = ["--max-tokens", "32", "--rounds", "2", "--domains", "planner,text", "--json"]
    certify = ["--drafter", "draft_model", "--temperature", "1.0", "--draws", "3000", "--trees", "none"]
    train = os.path.join(os.path.dirname(bundle), "train")
    return [["export", "--to", "onnx", "--bundle", bundle, "--precision", "fp16"],
            # on the CUDA EP the draft model, the EAGLE-3 chain and the MTP module draft through their K-step graphs
            # (the fp16 export writes them; params.kstep auto takes them on a GPU provider): greedy identity and the
            # runs per path say so
            ["bench", "--config", jetson, "--bundle", bundle, "--drafters", "none,draft_model,eagle3_chain,mtp", *bench],
            ["certify", "--config", jetson, "--bundle", bundle, *certify],
            ["export", "--to", "tensorrt", "--bundle", bundle, "--max-context", "960", "--verify-tokens", "16"],
            ["bench", "--config", trt, "--bundle", bundle, "--max-context", "960", "--drafters", "none,draft_model", *bench],
            ["certify", "--config", trt, "--bundle", bundle, "--max-context", "960", *certify],
            # the drafter trainer's CUDA path (bf16 target, autocast, feature cache, held-out curve): ~1 min
            ["train-drafter", "eagle3", "--target", "zoo/target", "--out", f"{train}/eagle3", "--work", f"{train}/work",
             "--cache-dir", f"{train}/cache", "--device", "cuda", "--steps", "40", "--batch", "8", "--seq-len", "256",
             "--eval-every", "20", "--eval-rows", "16", "--cache-rows", "64", "--zoo-examples", "400",
             "--zoo-domains", "planner,action", "--force"]]


def execute(steps, args, start: float) -> List[Tuple[str, str, str, float, str]]:
    """Run the planned checks in order; a failed prerequisite skips what depends on it."""
    os.makedirs(args.work, exist_ok=True)
    bundle = os.path.join(args.work, "zoo")
    cmds = dict(zip(("onnx-export", "onnx-bench", "onnx-certify", "trt-export", "trt-bench", "trt-certify", "train"),
                    commands(bundle)))
    graphs_cfg = os.path.join(args.work, "runtime_tensorrt_graphs.yaml")
    with open(os.path.join(ROOT, "configs", "runtime_tensorrt.yaml")) as f:
        text = f.read()
    with open(graphs_cfg, "w") as f:
        f.write(text.replace("  precision: fp16", "  precision: fp16\n  cuda_graphs: true"))
    results, failed, no_bundle = [], set(), None
    if any(why is None for _, _, why in steps) and not os.path.isdir(bundle):
        if os.path.isfile(os.path.join(args.bundle, "bundle.yaml")):
            shutil.copytree(args.bundle, bundle)
        else:  # build it from the zoo checkpoints in the repository (numpy + PyYAML only)
            rc, out = run(CLI + ["bundle", "--target", "zoo/target", "--draft", "zoo/draft", "--out", bundle], 120)
            if rc != 0:
                no_bundle = f"no bundle at {args.bundle} and none could be built from zoo/: {out.strip()[-120:]}"
    for check, backend, why in steps:
        left = args.budget_s - (time.time() - start)
        t0 = time.time()
        prefix = "onnx" if backend.startswith("onnx") else "torch" if backend == "torch CUDA" else "trt"
        if why is None and left < 20:
            why = f"the {args.budget_s:.0f} s budget is spent"
        if why is None and prefix in failed:
            why = "an earlier step of this backend failed"
        if why is None and no_bundle and backend != "torch CUDA":
            why = no_bundle
        if why is not None:
            results.append((backend, check, "SKIPPED", 0.0, why))
            continue
        ok, detail = True, ""
        try:
            if check in ("fp16 ONNX export", "engine build"):
                rc, out = run(CLI + cmds[f"{prefix}-export"], left)
                ok, detail = rc == 0, (out.strip().splitlines() or [""])[-1][:150]
            elif check == "equivalence vs numpy":
                cfg = os.path.join(ROOT, "configs", "runtime_jetson.yaml" if prefix == "onnx" else "runtime_tensorrt.yaml")
                ok, detail = equivalence(bundle, "onnx" if prefix == "onnx" else "tensorrt", cfg)
            elif check == "equivalence, CUDA graphs":
                ok, detail = equivalence(bundle, "tensorrt", graphs_cfg)
            elif check == "forward cost by T x ctx":
                rc, out = run([sys.executable, "-m", "runtime.commands.bench_backend", "--bundle", bundle, "--backend",
                               "tensorrt", "--contexts", "64", "512", "--repeats", "5"], left)
                print(out)  # the whole table goes above the summary
                lines = [ln for ln in out.splitlines() if "bandwidth" in ln or "decode" in ln]
                ok, detail = rc == 0, (lines[-1] if lines else out.strip()[-150:])[:150]
            elif check.startswith("greedy identity") or check == "bench with CUDA graphs":
                cmd = list(cmds[f"{prefix}-bench"])
                if check == "bench with CUDA graphs":
                    cmd[cmd.index("--config") + 1] = graphs_cfg
                rc, out = run(CLI + cmd, left)
                ok, detail = bench_summary(out) if "[" in out else (False, out.strip()[-150:])
            elif backend == "torch CUDA":
                rc, out = run(CLI + cmds["train"], left)
                print(out)  # the training log (held-out curve, cached-epoch speed-up) goes above the summary
                lines = [ln for ln in out.splitlines() if "held-out at step" in ln]
                ok, detail = rc == 0, (lines[-1] if lines and rc == 0 else out.strip()[-150:])[-150:]
            elif check == "certify":
                rc, out = run(CLI + cmds[f"{prefix}-certify"], left)
                lines = [ln for ln in out.splitlines() if ln.startswith("certify:")]
                ok, detail = rc == 0, (lines[-1] if lines else out.strip()[-150:])[:150]
        except Exception as exc:  # a check that crashes is a FAIL with its reason, and the table still prints
            ok, detail = False, f"{exc.__class__.__name__}: {exc}"[:150]
        if not ok and check in ("fp16 ONNX export", "engine build"):
            failed.add(prefix)
        results.append((backend, check, "PASS" if ok else "FAIL", time.time() - t0, detail))
    return results


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
