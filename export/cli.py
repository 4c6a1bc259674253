"""Workstation subcommands of `edgespec` (registered by runtime.cli when this package is installed)."""
from __future__ import annotations

import importlib

# Each module has `register(subparsers)`.
EXPORT_COMMANDS = ["export.bundle.cli", "export.compile", "export.zoo.cli", "export.drafters.cli"]


def register(sub) -> None:
    for module in EXPORT_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # The Jetson image ships only the TensorRT engine builder of export/ (engines are built on the device);
            # a command whose module is not there is simply not offered.
            if (exc.name or "").startswith("export"):
                continue
            raise
        mod.register(sub)
