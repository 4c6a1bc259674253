"""scripts/gpu_check.sh, the one prepared GPU check (ONNX Runtime CUDA EP and TensorRT), as far as it runs here: on a
machine without a GPU it says SKIPPED and exits 0; its plan names what is missing for each check; every edgespec
command it runs parses."""
from __future__ import annotations

from tests.support import REPO_ROOT
import os
import shlex
import subprocess
import sys

from runtime.cli import build_parser

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402

HAS = {"gpu": "NVIDIA H200, 570.1", "numpy": "2", "yaml": "6", "tokenizers": "0.21", "torch": "2.6", "onnx": "1.17",
       "onnxscript": None, "onnxruntime": "1.20.1", "ort_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
       "tensorrt": None, "tensorrt_error": "ModuleNotFoundError: No module named 'tensorrt'", "cuda-python": None}


def script(*args, path=None):
    env = {**os.environ, "PYTHON": sys.executable, "PATH": path or os.environ["PATH"]}
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env, cwd="/")


def test_without_a_gpu_the_check_says_skipped_and_exits_0(tmp_path):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    out = script(path=f"{tmp_path}:{os.environ['PATH']}")  # a driverless machine: nvidia-smi fails
    assert out.returncode == 0, out.stderr
    assert "gpu_check: SKIPPED: no NVIDIA GPU here" in out.stdout


def test_the_plan_runs_the_cuda_provider_and_names_what_is_missing_for_the_rest():
    rows = {(backend, check): why for check, backend, why in gpu_check.plan(HAS)}
    assert "onnxscript" in rows[("onnx CUDA EP", "fp16 ONNX export")]
    assert rows[("onnx CUDA EP", "equivalence vs numpy")] is None and rows[("onnx CUDA EP", "certify")] is None
    assert "No module named 'tensorrt'" in rows[("tensorrt", "engine build")]
    cpu_only = {**HAS, "ort_providers": ["CPUExecutionProvider"]}
    assert "onnxruntime-gpu is not installed" in dict(((b, c), w) for c, b, w in gpu_check.plan(cpu_only))[
        ("onnx CUDA EP", "greedy identity + bench")]
    assert "sees no CUDA device" in rows[("torch CUDA", "train-drafter, feature cache")]
    assert gpu_check.plan({**HAS, "torch_cuda": True})[-1] == ("train-drafter, feature cache", "torch CUDA", None)
    with_trt = {**HAS, "tensorrt": "10.3.0", "cuda-python": "yes"}
    assert all(why is None for check, backend, why in gpu_check.plan(with_trt) if backend == "tensorrt")


def test_every_command_the_check_runs_parses_and_its_configs_exist():
    out = script("--dry-run")
    assert out.returncode == 0, out.stderr
    cmds = [line.split("$ edgespec ", 1)[1] for line in out.stdout.splitlines() if "$ edgespec " in line]
    assert len(cmds) == 7 and cmds == [" ".join(c) for c in gpu_check.commands("WORK/zoo")]
    parser = build_parser()
    for cmd in cmds:
        words = shlex.split(cmd)
        parser.parse_args(words)
        if "--config" in words:
            assert os.path.isfile(os.path.join(ROOT, words[words.index("--config") + 1])), cmd
