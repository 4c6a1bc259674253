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


def test_a_settled_grid_times_each_cell_right_after_a_forward_of_its_own_shape():
    """`settle=1` (edgespec tune): every timed forward follows an untimed one of the same rows and context, so a
    1-row cell is timed as a plain step after a plain step, not as the switch from a 48-row cell; the dropped
    warm-up round runs each cell once, unsettled."""
    import numpy as np

    from runtime.commands.bench_backend import CONTROL, interleaved_grid

    class Cache:
        length = 0

    class Target:
        spec = type("Spec", (), {"vocab_size": 16})
        cache = Cache()
        calls = []

        def keep(self, start, rows):
            self.cache.length = start

        def forward(self, tokens, positions):
            self.calls.append((len(tokens), int(positions[0])))

    target = Target()
    times = interleaved_grid([target], [8, 32], [1, 4], 2, np.random.default_rng(0), settle=1)
    cells = 3 * 2  # rows 1, 4 and the 1-row control, at two contexts
    warm_up, timed = target.calls[:cells], target.calls[cells:]
    assert len(warm_up) == cells and len(timed) == 2 * 2 * cells
    assert all(timed[i] == timed[i + 1] for i in range(0, len(timed), 2))  # (settle, timed) pairs of one shape
    assert set(times) == {(0, t, c) for t in (1, 4, CONTROL) for c in (8, 32)}
    assert all(len(v) == 2 for v in times.values())
