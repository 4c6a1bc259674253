"""How many threads numpy's BLAS uses for the numpy backend and drafters.

Batch-1 decoding multiplies a vector by a matrix: the work per call is small, and OpenBLAS's worker
threads only pay off for big matrices on idle cores. When the cores are shared (ONNX Runtime's pool,
ROS executors, other processes) a two-thread gemv waits for a descheduled worker and gets ~25x slower
(0.44 ms -> 12 ms for a 3072x256 head on this 2-core VM). The runtime therefore sets the BLAS thread
count explicitly, the way ONNX Runtime's intra-op count is set."""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

# Entry points of the OpenBLAS builds numpy ships (numpy 2: scipy-openblas, 64-bit ints) and of plain OpenBLAS.
_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _openblas_libraries():
    base = os.path.dirname(os.path.dirname(np.__file__))
    return glob.glob(os.path.join(base, "numpy.libs", "*openblas*")) + glob.glob(
        os.path.join(os.path.dirname(np.__file__), ".dylibs", "*openblas*"))


def set_blas_threads(n: int) -> bool:
    """Set numpy's OpenBLAS thread count; returns False (and changes nothing) where it cannot."""
    done = False
    for path in _openblas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SYMBOLS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(int(n)))
                done = True
                break
    return done
