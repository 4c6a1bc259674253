#!/usr/bin/env bash
# Bootstrap a fresh machine for edgespec: venv, Python packages, ROS 2 interfaces, the zoo bundle.
# Idempotent: each step leaves a stamp keyed on its inputs and is skipped when nothing changed.
# Usage: scripts/bootstrap.sh [all|demo|python|ros|bundles|llama_cpp]
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

# llama.cpp (the gguf backend), compiled from the llama-cpp-python sdist NON-native: a -march=native build
# enables ggml's AMX kernels where the CPU advertises AMX and q8_0 models then die with SIGILL on such VMs.
# AVX2/FMA/F16C is the portable x86-64 baseline here; the wheel is cached under .cache/wheels (~10 min to build
# on 2 quiet cores, once; the multimodal library is not built). On aarch64 (Jetson) the x86 flags are left out.
LLAMA_CPP_VERSION=0.3.36
llama_cpp() {
  local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF"
  if [ "$(uname -m)" = x86_64 ]; then
    args="$args -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
  fi
  local key; key=$(echo "$LLAMA_CPP_VERSION $args" | sha256sum | cut -c1-16)
  if stamp_ok llama_cpp "$key" && "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
    echo "== bootstrap: llama-cpp-python up to date"; return
  fi
  # Already installed at this version and built without AMX (its system info lists the kernels compiled in).
  if "$VENV/bin/python" -c "import llama_cpp, sys; info = llama_cpp.llama_print_system_info().decode()
sys.exit(0 if llama_cpp.__version__ == '$LLAMA_CPP_VERSION' and 'AMX' not in info else 1)" 2>/dev/null; then
    echo "== bootstrap: llama-cpp-python $LLAMA_CPP_VERSION (no AMX kernels) already installed"
    stamp_set llama_cpp "$key"; return
  fi
  local wheels=".cache/wheels/llama_cpp-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    step "building llama-cpp-python $LLAMA_CPP_VERSION non-native into $wheels (about 10 min on 2 cores, once)"
    mkdir -p "$wheels"
    if ! CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$VENV/bin/pip" wheel --no-deps --progress-bar off -w "$wheels" "llama-cpp-python==$LLAMA_CPP_VERSION" \
      > "$wheels/build.log" 2>&1 || ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
      # Not fatal: the gguf backend's tests then skip, naming this log; everything else still runs.
      tail -n 15 "$wheels/build.log" >&2
      echo "== bootstrap: WARNING: building llama-cpp-python failed (log: $wheels/build.log); the gguf backend" \
           "and its tests are unavailable until \`scripts/bootstrap.sh llama_cpp\` succeeds" >&2
      return 0
    fi
  fi
  step "installing llama-cpp-python from $wheels"
  "$VENV/bin/pip" install --no-deps --force-reinstall --progress-bar off "$wheels"/llama_cpp_python-*.whl 2>&1 | tail -n 1
  "$VENV/bin/pip" install --progress-bar off 'diskcache>=5.6.1' 'jinja2>=2.11.3' 'typing-extensions>=4.5.0' 2>&1 \
    | grep -v '^WARNING: Location' | tail -n 1
  stamp_set llama_cpp "$key"
}

ros() {
  if [ -x scripts/bootstrap_ros.sh ]; then
    step "ROS 2 wheels and interfaces"
    scripts/bootstrap_ros.sh "$VENV"
  fi
}

bundles() {
  local key; key=$(hash_of zoo/MANIFEST.yaml zoo/target/* zoo/draft/* zoo/medusa/* zoo/eagle1/* zoo/eagle3/* zoo/dflash/* zoo/dflash2/* export/bundle/*.py runtime/model/bundle.py export/onnx/*.py export/drafters/medusa.py export/drafters/eagle.py export/drafters/dflash.py export/drafters/*_onnx.py export/drafters/*_kstep.py export/drafters/registry.py export/drafters/kinds/*.py)  # every file the bundle's build reads
  if [ ! -f zoo/MANIFEST.yaml ]; then echo "== bootstrap: no zoo/ in this checkout; skipping the bundle"; return; fi
  if stamp_ok bundles "$key" && [ -f build/bundles/zoo/bundle.yaml ]; then echo "== bootstrap: zoo bundle up to date"; return; fi
  step "building the zoo bundle (build/bundles/zoo) from zoo/"
  rm -rf build/bundles/zoo
  local medusa=(); if [ -f zoo/medusa/medusa_lm_head.safetensors ]; then medusa=(--medusa zoo/medusa); fi
  local eagle=(); if [ -f zoo/eagle1/model.safetensors ]; then eagle+=(--eagle zoo/eagle1); fi
  if [ -f zoo/eagle3/model.safetensors ]; then eagle+=(--eagle3 zoo/eagle3); fi
  local dflash=(); for d in dflash dflash2; do if [ -f zoo/$d/model.safetensors ]; then dflash+=(--dflash zoo/$d); fi; done
  "$VENV/bin/edgespec" bundle --target zoo/target --draft zoo/draft "${medusa[@]}" "${eagle[@]}" "${dflash[@]}" --out build/bundles/zoo --backends numpy_ref,onnx
  stamp_set bundles "$key"
}

start=$(date +%s)
case "$what" in
  python) python_deps ;;
  ros) python_deps; ros ;;
  bundles) python_deps; bundles ;;
  llama_cpp) python_deps; llama_cpp ;;
  all) python_deps; llama_cpp; ros; bundles ;;
  demo) python_deps; ros; bundles ;;  # make demo needs no llama.cpp build
  *) echo "usage: $0 [all|demo|python|ros|bundles|llama_cpp]" >&2; exit 2 ;;
esac
echo "== bootstrap: done in $(( $(date +%s) - start )) s"
