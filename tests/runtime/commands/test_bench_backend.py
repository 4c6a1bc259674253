"""runtime/commands/bench_backend.py opens its targets as a Session does, through runtime/backends/factory.open_model:
a bench of a backend measures the target the runtime serves, not a second construction of it."""
import ast
import os

from runtime.backends.numpy_ref import NumpyTarget
from runtime.commands.bench_backend import open_target
from runtime.model import bundle as bundle_io
from tests.support import REPO_ROOT

TARGET_CLASSES = {"NumpyTarget", "OnnxTarget", "TensorRTTarget", "LlamaCppTarget"}


def test_the_backend_bench_builds_no_target_class_itself():
    tree = ast.parse(open(os.path.join(REPO_ROOT, "runtime", "commands", "bench_backend.py"), encoding="utf-8").read())
    built = sorted({n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in TARGET_CLASSES})
    assert built == []


def test_the_bench_opens_the_numpy_target_the_session_would_on_an_arena_of_the_rows_asked(tiny_bundle):
    b = bundle_io.load(tiny_bundle)
    target = open_target(b, "numpy_ref", 40, threads=1)
    assert type(target) is NumpyTarget and target.cache.max_positions == 40 and target.cache.k.dtype.name == "float32"
    assert target.forward([1, 2, 3], [0, 1, 2]).logits.shape == (3, b.target.spec.vocab_size)
