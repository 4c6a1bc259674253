#!/usr/bin/env bash
# The GPU check, shared by the ONNX Runtime CUDA path and TensorRT: on a machine with an NVIDIA GPU it runs what
# that machine allows (the CUDA execution provider always, TensorRT when importable): equivalence against the
# numpy reference, greedy identity, a short `edgespec certify` and `edgespec bench`, in <= 10 minutes, and prints
# one summary table. Without a GPU it prints a SKIPPED line and exits 0. Details: scripts/gpu_check.py.
# Usage: scripts/gpu_check.sh [--dry-run] [--no-install] [--bundle DIR] [--work DIR] [--budget-s S]
# Runs from a plain copy of the repository: it needs Python 3.10+ with numpy (torch + onnx to export the fp16
# graphs), uses .venv/bin/python when there is one, else $PYTHON, else python3; it never needs the internet (a
# missing package is tried once with pip, then named as missing).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_check: SKIPPED: no Python interpreter ($py) on this machine"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=INT 590 "$py" scripts/gpu_check.py "$@"
