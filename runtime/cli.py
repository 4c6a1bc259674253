"""The `edgespec` command. Runtime subcommands live here; workstation subcommands (export, zoo, ...)
are added by the `export` package when it is installed, so the robot image needs no torch."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from runtime.errors import EdgespecError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgespec",
        description="edgespec: exact speculative decoding for robots. Run `edgespec <command> --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for module in RUNTIME_COMMANDS:
        importlib.import_module(module).register(sub)
    try:
        # Imported by name so that the robot side never depends on the workstation package.
        workstation = importlib.import_module("export.cli")
    except ImportError:
        workstation = None
    if workstation is not None:
        workstation.register(sub)
    return parser


# Each module has `register(subparsers)` adding its subcommand(s) with a `func(args) -> int` default.
RUNTIME_COMMANDS: List[str] = ["runtime.commands.generate", "runtime.commands.certify", "runtime.commands.bench",
                                  "runtime.commands.memory", "runtime.commands.tune"]


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EdgespecError as exc:
        print(f"edgespec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
