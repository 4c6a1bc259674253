#!/usr/bin/env bash
# Bootstrap a fresh machine for edgespec: venv, Python packages, ROS 2 interfaces, the zoo bundle.
# Idempotent: each step leaves a stamp keyed on its inputs and is skipped when nothing changed.
# Usage: scripts/bootstrap.sh [all|python|ros|bundles]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
STAMPS="$VENV/.stamps"
what=${1:-all}

step() { printf '\n== bootstrap: %s\n' "$*"; }
stamp_ok() { [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }
stamp_set() { mkdir -p "$STAMPS"; echo "$2" > "$STAMPS/$1"; }
hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

python_deps() {
  if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
  fi
  local key; key=$(hash_of pyproject.toml)
  if stamp_ok python "$key"; then echo "== bootstrap: python packages up to date"; return; fi
  step "installing torch==2.13.0 (CPU build from local disk; export side and tests only)"
  "$VENV/bin/pip" install --progress-bar off torch==2.13.0 2>&1 | grep -v '^WARNING: Location' | tail -n 2
  step "installing edgespec with extras onnx, export, test, peers, plot"
  "$VENV/bin/pip" install --progress-bar off -e '.[onnx,export,test,peers,plot]' 2>&1 | grep -v '^WARNING: Location' | tail -n 2
  stamp_set python "$key"
}

ros() {
  if [ -x scripts/bootstrap_ros.sh ]; then
    step "ROS 2 wheels and interfaces"
    scripts/bootstrap_ros.sh "$VENV"
  fi
}

bundles() {
  local key; key=$(hash_of zoo/MANIFEST.yaml zoo/target/* zoo/draft/* zoo/medusa/* zoo/eagle1/* zoo/eagle3/* export/bundle_builder.py runtime/bundle.py export/onnx.py export/drafters/medusa.py export/drafters/eagle.py)
  if [ ! -f zoo/MANIFEST.yaml ]; then echo "== bootstrap: no zoo/ in this checkout; skipping the bundle"; return; fi
  if stamp_ok bundles "$key" && [ -f build/bundles/zoo/bundle.yaml ]; then echo "== bootstrap: zoo bundle up to date"; return; fi
  step "building the zoo bundle (build/bundles/zoo) from zoo/"
  rm -rf build/bundles/zoo
  local medusa=(); if [ -f zoo/medusa/medusa_lm_head.safetensors ]; then medusa=(--medusa zoo/medusa); fi
  local eagle=(); if [ -f zoo/eagle1/model.safetensors ]; then eagle+=(--eagle zoo/eagle1); fi
  if [ -f zoo/eagle3/model.safetensors ]; then eagle+=(--eagle3 zoo/eagle3); fi
  "$VENV/bin/edgespec" bundle --target zoo/target --draft zoo/draft "${medusa[@]}" "${eagle[@]}" --out build/bundles/zoo --backends numpy_ref,onnx
  stamp_set bundles "$key"
}

start=$(date +%s)
case "$what" in
  python) python_deps ;;
  ros) python_deps; ros ;;
  bundles) python_deps; bundles ;;
  all) python_deps; ros; bundles ;;
  *) echo "usage: $0 [all|python|ros|bundles]" >&2; exit 2 ;;
esac
echo "== bootstrap: done in $(( $(date +%s) - start )) s"
