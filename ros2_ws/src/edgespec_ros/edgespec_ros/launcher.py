"""A small launcher for machines without `ros2 launch` (the PyPI wheels have no launch package).

    python -m edgespec_ros.launcher configs/ros/demo_launch.yaml

The YAML lists nodes; each starts as its own process with the usual ROS arguments:

    nodes:
      - name: edgespec                   # -r __node:=edgespec
        package: edgespec_ros            # where to look for the executable: <prefix>/lib/<package>/
        executable: edgespec_node        # ... or a console script next to this Python
        namespace: /spec                 # -r __ns:=/spec
        params_file: configs/ros/edgespec.yaml   # --params-file; relative to the working directory
        parameters: {autostart: true}    # -p autostart:=true, after the params file so they win
        required: true                   # when it exits, stop everything
        env: {}                          # extra environment variables

Ctrl-C (or SIGTERM) stops every node with SIGINT, then SIGTERM after `--grace` seconds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import yaml

from runtime.errors import ConfigError


@dataclass(frozen=True)
class NodeSpec:
    package: str
    executable: str
    name: str = ""
    namespace: str = ""
    params_file: str = ""
    parameters: Dict[str, object] = field(default_factory=dict)
    required: bool = False
    env: Dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.namespace.rstrip('/')}/{self.name or self.executable}"


def load(path: str) -> List[NodeSpec]:
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise ConfigError(f"{path}: expected a mapping with a non-empty list `nodes`")
    known = set(NodeSpec.__dataclass_fields__)
    specs = []
    for i, entry in enumerate(data["nodes"]):
        where = f"{path}: nodes[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping, got {entry!r}")
        unknown = set(entry) - known
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(known)}")
        for key in ("package", "executable"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ConfigError(f"{where}: `{key}` must be a non-empty string")
        for key in ("parameters", "env"):
            if not isinstance(entry.get(key, {}), dict):
                raise ConfigError(f"{where}: `{key}` must be a mapping")
        if entry.get("params_file") and not os.path.isfile(entry["params_file"]):
            raise ConfigError(f"{where}: params_file {entry['params_file']!r} does not exist")
        specs.append(NodeSpec(**entry))
    return specs


def find_executable(package: str, executable: str) -> str:
    """Like `ros2 run`: <prefix>/lib/<package>/<executable> (colcon), else a console script on this venv."""
    candidates = [os.path.join(prefix, "lib", package, executable)
                  for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if prefix]
    candidates += [os.path.join(sys.prefix, "lib", package, executable),
                   os.path.join(os.path.dirname(sys.executable), executable)]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(executable)
    if found:
        return found
    raise ConfigError(f"executable {executable!r} of package {package!r} not found (looked in {candidates} and "
                      f"PATH); run scripts/bootstrap_ros.sh or colcon build")


def _param_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def command(spec: NodeSpec) -> List[str]:
    cmd = [find_executable(spec.package, spec.executable), "--ros-args"]
    if spec.name:
        cmd += ["-r", f"__node:={spec.name}"]
    if spec.namespace:
        cmd += ["-r", f"__ns:={spec.namespace}"]
    if spec.params_file:
        cmd += ["--params-file", os.path.abspath(spec.params_file)]
    for key, value in spec.parameters.items():
        cmd += ["-p", f"{key}:={_param_value(value)}"]
    return cmd


def run(specs: List[NodeSpec], grace_s: float = 5.0) -> int:
    procs: List[subprocess.Popen] = []
    stopping = False

    def stop(*_args) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for spec in specs:
        cmd = command(spec)
        print(f"[launcher] starting {spec.label}: {' '.join(cmd)}", flush=True)
        procs.append(subprocess.Popen(cmd, env={**os.environ, **{k: str(v) for k, v in spec.env.items()}}))
    rc = 0
    try:
        while not stopping:
            running = [p for p in procs if p.poll() is None]
            for spec, p in zip(specs, procs):
                if p.returncode is not None and spec.required:
                    print(f"[launcher] required node {spec.label} exited with {p.returncode}; stopping", flush=True)
                    rc = p.returncode or rc
                    stopping = True
            if not running:
                break
            time.sleep(0.1)
    finally:
        _stop_all(procs, grace_s)
    return rc


def _stop_all(procs: List[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="edgespec_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("launch_yaml", help="e.g. configs/ros/demo_launch.yaml")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGINT and SIGTERM at stop")
    args = parser.parse_args(argv)
    try:
        return run(load(args.launch_yaml), args.grace)
    except ConfigError as exc:
        print(f"edgespec_launch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
