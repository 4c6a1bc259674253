"""The libraries' own chatter during an export: hidden by default, shown with `--verbose`.

An ONNX export prints torch.onnx's registry notes ("torchvision is not installed. Skipping torchvision::nms"),
FutureWarnings and UserWarnings about its own internals, and a GGUF export llama.cpp's loader and quantiser
lines (one per tensor and metadata key, ~95 for a small model): none of it is about the user's model, and
it buries edgespec's own lines (what was written, the error against the numpy reference). `quiet_library()`
goes around each library call only, so a warning from anywhere else still shows; `edgespec export --verbose`
and `edgespec bundle --verbose` turn it off for the whole run."""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

# Loggers the export's libraries write to (torch.onnx's registry notes, onnxscript's optimiser, torch.export).
LIBRARY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch.fx", "torch._dynamo", "onnxscript", "onnx_ir")

_verbose = False


def set_verbose(on: bool) -> None:
    """Show (True) or hide (False, the default) the libraries' logs and warnings for the rest of the run."""
    global _verbose
    _verbose = bool(on)
    from runtime.backends import llamacpp  # llama.cpp's log goes through one callback: echo it or keep it

    llamacpp.echo_library_log(_verbose)


def verbose() -> bool:
    return _verbose


@contextlib.contextmanager
def quiet_library() -> Iterator[None]:
    """Around one library call: its Python warnings ignored and its loggers raised to ERROR, both restored
    after (errors still show, and still raise); nothing changes when --verbose asked for the logs."""
    if _verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [log.level for log in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for log in loggers:
            log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for log, level in zip(loggers, levels):
                log.setLevel(level)
