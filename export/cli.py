"""Workstation subcommands of `edgespec` (registered by runtime.cli when this package is installed)."""
from __future__ import annotations

import importlib

# Each module has `register(subparsers)`.
EXPORT_COMMANDS = ["export.bundle_cli", "export.onnx_cli", "export.zoo.cli", "export.drafters.cli"]


def register(sub) -> None:
    for module in EXPORT_COMMANDS:
        importlib.import_module(module).register(sub)
