"""The robot side never imports torch, transformers or the workstation package `export`, and it parses
under Python 3.10 (what JetPack 6 ships).

Each runtime module is imported in a fresh interpreter, so one module's imports cannot hide another's."""
from __future__ import annotations

from tests.support import REPO_ROOT
import glob
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import runtime

ROOT = REPO_ROOT
FORBIDDEN = ("torch", "transformers", "export")
# A backend module may need its own optional package; only these may be missing, and only as an ImportError.
OPTIONAL_BACKEND_DEPS = ("onnxruntime", "llama_cpp", "tensorrt", "pycuda")
SKIPPED = 3  # exit status of the probe when an optional backend dependency is missing

PROBE = r"""
import importlib, json, sys
name, optional, forbidden = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
try:
    importlib.import_module(name)
except ImportError as exc:
    if any(dep in str(exc) for dep in optional):
        print(json.dumps({"skipped": f"{type(exc).__name__}: {exc}"}))
        sys.exit(3)
    raise
loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
print(json.dumps({"forbidden_loaded": loaded}))
"""


def runtime_modules():
    names = [runtime.__name__]
    for info in pkgutil.walk_packages(runtime.__path__, prefix=runtime.__name__ + "."):
        names.append(info.name)
    return sorted(names)


MODULES = runtime_modules()


def test_the_walk_finds_the_runtime_modules():
    for name in ("runtime.model.bundle", "runtime.config", "runtime.decode.engine", "runtime.backends.numpy_ref",
                 "runtime.drafters.ngram"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_importing_a_runtime_module_loads_no_torch_transformers_or_export(name):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, name, ",".join(OPTIONAL_BACKEND_DEPS), ",".join(FORBIDDEN)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == SKIPPED:
        reason = json.loads(proc.stdout.strip().splitlines()[-1])["skipped"]
        print(f"note: {name} not checked: its optional backend dependency is not installed here ({reason})")
        pytest.skip(f"{name}: optional backend dependency missing ({reason})")
    assert proc.returncode == 0, f"importing {name} failed:\n{proc.stderr}"
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])["forbidden_loaded"]
    assert loaded == [], f"importing {name} loaded {loaded}; the robot side must not depend on them"


PY310 = sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"))


@pytest.mark.skipif(not PY310, reason="no /root/.pyenv/versions/3.10*/bin/python3.10 here to check JetPack 6's Python")
def test_every_runtime_source_parses_under_python_3_10(tmp_path):
    sources = sorted(glob.glob(os.path.join(ROOT, "runtime", "**", "*.py"), recursive=True))
    assert sources
    # Byte-code goes to tmp_path, not into the tree, so a 3.10 .pyc never lands next to the sources.
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path))
    proc = subprocess.run([PY310[-1], "-m", "py_compile", *sources], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"runtime/ does not parse under Python 3.10 (JetPack 6):\n{proc.stderr}"
