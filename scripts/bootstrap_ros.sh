#!/usr/bin/env bash
# Install ROS 2 Kilted from its PyPI wheels into a venv, build edgespec_interfaces into that venv and
# install edgespec_ros, so that `python -m edgespec_ros.node` runs from the venv with nothing to source.
#
#   scripts/bootstrap_ros.sh [VENV]        (default: .venv; created with python3 if missing)
#
# Idempotent: each step is skipped when a stamp in VENV/.edgespec-ros/ says it was done with the same
# inputs. Set FORCE=1 to redo every step. Why the steps are what they are: shared/notes/ros2-from-pypi.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_ARG="${1:-.venv}"
case "$VENV_ARG" in /*) VENV="$VENV_ARG" ;; *) VENV="$ROOT/$VENV_ARG" ;; esac
STAMPS="$VENV/.edgespec-ros"
IFACE_SRC="$ROOT/ros2_ws/src/edgespec_interfaces"
IFACE_BUILD="$ROOT/ros2_ws/build/edgespec_interfaces"
NODE_SRC="$ROOT/ros2_ws/src/edgespec_ros"

# The wheels do not declare what building an interface package needs, so the list is explicit.
# Kilted only: never mix distros in one venv (the unprefixed ros-* wheels have different pins).
ROS_WHEELS=(
  "ros-kilted-rclpy[fastrtps]" ros-kilted-std-msgs ros-kilted-std-srvs ros-kilted-diagnostic-msgs
  ros-kilted-lifecycle-msgs ros-kilted-ament-cmake ros-kilted-ament-package
  ros-kilted-ament-cmake-include-directories ros-kilted-ament-cmake-ros-core ros-kilted-ament-cmake-ros
  ros-kilted-rosidl-default-generators ros-kilted-rosidl-core-generators catkin-pkg
)

step_t0=0
step() { step_t0=$(date +%s); echo "==> [bootstrap_ros] $*"; }
done_in() { echo "    done in $(( $(date +%s) - step_t0 )) s${1:+ ($1)}"; }
skip() { echo "    skipped: $*"; }
die() { echo "bootstrap_ros: error: $*" >&2; exit 1; }
fingerprint() { cat "$@" | sha256sum | cut -c1-16; }
stamp_is() { [[ "${FORCE:-0}" != 1 && -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
stamp_set() { mkdir -p "$STAMPS"; echo "$2" > "$STAMPS/$1"; }

total_t0=$(date +%s)

step "venv at $VENV"
if [[ -x "$VENV/bin/python" ]]; then
  skip "exists ($("$VENV/bin/python" -V 2>&1))"
else
  "${PYTHON:-python3}" -m venv "$VENV"
  done_in "created"
fi
PY="$VENV/bin/python"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "the ROS 2 wheels need Python >= 3.10"
command -v cmake >/dev/null || die "cmake >= 3.20 is needed to build edgespec_interfaces (apt-get install cmake)"
command -v g++ >/dev/null || die "g++ is needed to build edgespec_interfaces (apt-get install g++)"

step "ROS 2 Kilted wheels"
key="$(printf '%s\n' "${ROS_WHEELS[@]}" | sha256sum | cut -c1-16)"
if stamp_is wheels "$key" && "$PY" -c 'import rclpy, diagnostic_msgs.msg, lifecycle_msgs.srv' 2>/dev/null; then
  skip "installed"
else
  mkdir -p "$STAMPS"
  # setuptools >= 70.1 builds the editable edgespec_ros below without build isolation (it has bdist_wheel).
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "${ROS_WHEELS[@]}" numpy pyyaml \
    "setuptools>=70.1" > "$STAMPS/pip-wheels.log" 2>&1 \
    || { grep -v '^WARNING: Location' "$STAMPS/pip-wheels.log" | tail -n 30 >&2; die "pip install of the ROS 2 wheels failed"; }
  stamp_set wheels "$key"
  done_in "$("$PY" -c 'import importlib.metadata as m; print("rclpy", m.version("ros-rclpy"))')"
fi

step "work-around 1: point the wheels' exported CMake files at this venv's Python and numpy headers"
PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
NP_INC="$("$PY" -c 'import numpy; print(numpy.get_include())')"
[[ -f "$PY_INC/Python.h" ]] || die "no Python.h in $PY_INC: install this Python's development headers"
mapfile -t stale < <(grep -rlE '/opt/python/cp[0-9]+-cp[0-9]+/' "$VENV/share" --include='*.cmake' 2>/dev/null || true)
if [[ ${#stale[@]} -eq 0 ]]; then
  skip "no wheel-builder paths left"
else
  # The builder's paths: /opt/python/cpXY-cpXY/include/pythonX.Y and .../site-packages/numpy/_core/include.
  sed -i -E \
    -e "s#/opt/python/cp[0-9]+-cp[0-9]+/lib/python[0-9.]+/site-packages/numpy/(_core|core)/include#${NP_INC}#g" \
    -e "s#/opt/python/cp[0-9]+-cp[0-9]+/include/python[0-9.]+#${PY_INC}#g" \
    "${stale[@]}"
  done_in "${#stale[@]} files rewritten"
fi

step "work-around 2: build edgespec_interfaces with cmake and install it into the venv prefix"
key="$(cd "$IFACE_SRC" && fingerprint package.xml CMakeLists.txt msg/* srv/* action/*)-$("$PY" -V 2>&1 | tr -d ' ')"
if stamp_is interfaces "$key" && "$PY" -c 'import edgespec_interfaces.action, edgespec_interfaces.srv' 2>/dev/null; then
  skip "built from the same .msg/.srv/.action files"
else
  export AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
  export CMAKE_PREFIX_PATH="$VENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PATH="$VENV/bin:$PATH"
  rm -rf "$IFACE_BUILD"
  echo "    configuring (log: $IFACE_BUILD.log)"
  mkdir -p "$(dirname "$IFACE_BUILD")"
  {
    cmake -S "$IFACE_SRC" -B "$IFACE_BUILD" -DCMAKE_INSTALL_PREFIX="$VENV" -DBUILD_TESTING=OFF \
      -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" &&
    cmake --build "$IFACE_BUILD" -j "$(nproc)" &&
    cmake --install "$IFACE_BUILD"
  } > "$IFACE_BUILD.log" 2>&1 || { tail -n 40 "$IFACE_BUILD.log" >&2; die "interface build failed (full log: $IFACE_BUILD.log)"; }
  "$PY" -c 'import edgespec_interfaces.action, edgespec_interfaces.msg, edgespec_interfaces.srv' \
    || die "edgespec_interfaces built but does not import from $PY"
  stamp_set interfaces "$key"
  done_in
fi

step "edgespec_ros (editable, into the venv)"
key="$(cd "$NODE_SRC" && fingerprint setup.py setup.cfg package.xml)"
if stamp_is node "$key" && "$PY" -c 'import edgespec_ros.node' 2>/dev/null; then
  skip "installed"
else
  # Editable, so that the venv runs the node from the source tree; the build backend's chatter goes to a log.
  mkdir -p "$ROOT/ros2_ws/build"
  "$PY" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$NODE_SRC" \
    > "$ROOT/ros2_ws/build/edgespec_ros-pip.log" 2>&1 \
    || { tail -n 20 "$ROOT/ros2_ws/build/edgespec_ros-pip.log" >&2; die "pip install -e $NODE_SRC failed"; }
  stamp_set node "$key"
  done_in
fi

echo "==> [bootstrap_ros] ready in $(( $(date +%s) - total_t0 )) s: $VENV/bin/python -m edgespec_ros.node"
