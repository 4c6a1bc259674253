"""The house in floors: a module imports only its own floor or the floors below it, no two modules import each
other (directly or round a circle), drafters never import one another, and the robot side never imports the
workstation side. Every import counts, also one inside a function: a lazy import is still an arrow.

Floors of runtime/, bottom to top (docs/architecture.md draws them):
  0 maths and types: runtime.errors, runtime.config, runtime.verify, runtime.verify_typical, runtime.tree,
    runtime.sampling, runtime.siblings
  1 runtime.text      tokenizer, templates, prompts, actions, grammar
  2 runtime.model     spec, layers, tensors, bundle
  3 runtime.memory    kv arena, the memory plan, a bundle's sizes, budgets and devices
  4 runtime.backends  numpy_ref, onnx, llamacpp, tensorrt
  5 runtime.drafters  one file per drafter kind, on drafters.base / drafters.shared / drafters.heads
  6 runtime.decode    the engine
  7 runtime.certify   the statistical test of the engine
  8 runtime.serving   Session: bundle + backend + drafter + tokenizer
  9 runtime.commands, runtime.cli
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

import pytest

from tests.support import REPO_ROOT

FLOORS = {"runtime.errors": 0, "runtime.config": 0, "runtime.verify": 0, "runtime.verify_typical": 0,
          "runtime.tree": 0, "runtime.sampling": 0, "runtime.siblings": 0, "runtime.speculation": 0,
          "runtime.text": 1, "runtime.model": 2, "runtime.memory": 3, "runtime.backends": 4,
          "runtime.drafters": 5, "runtime.decode": 6, "runtime.certify": 7, "runtime.serving": 8,
          "runtime.commands": 9, "runtime.cli": 9}
SHARED_DRAFTER_MODULES = {"runtime.drafters.base", "runtime.drafters.shared", "runtime.drafters.heads"}
DRAFTER_REGISTRY = "runtime.drafters.registry"  # the one module that reaches every drafter kind (it finds them)


def _modules(package: str) -> Dict[str, str]:
    """{dotted module name: file} of every module of a package in this checkout."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(REPO_ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), REPO_ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, name)
    return out


def _imports(path: str, known: Set[str]) -> Set[str]:
    """The project modules a file imports (any import statement, also inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in known:
                found.add(name)
    return found


def _graph(*packages: str) -> Dict[str, Set[str]]:
    mods = {}
    for p in packages:
        mods.update(_modules(p))
    known = set(mods)
    return {m: _imports(f, known) - {m} for m, f in mods.items()}


def floor_of(module: str) -> int:
    """The floor of a runtime module: its longest listed prefix (runtime.memory.plan -> runtime.memory -> 3)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    raise KeyError(f"{module} is on no floor: add its package to FLOORS (and to docs/architecture.md)")


def cycles(graph: Dict[str, Set[str]]) -> List[Tuple[str, ...]]:
    """Every import circle, each once (Tarjan's strongly connected components of size > 1)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle_of_three():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_runtime_module_is_on_a_floor_and_imports_only_downward():
    graph = _graph("runtime")
    upward = [f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
              for m, deps in sorted(graph.items()) for d in sorted(deps)
              if m != "runtime" and d != "runtime" and floor_of(d) > floor_of(m)]
    assert upward == []


def test_drafters_never_import_one_another():
    graph = _graph("runtime")
    crossing = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith("runtime.drafters.")
                for d in sorted(deps) if d.startswith("runtime.drafters.") and d not in SHARED_DRAFTER_MODULES
                and m not in SHARED_DRAFTER_MODULES | {DRAFTER_REGISTRY} and d != "runtime.drafters"]
    assert crossing == []


def test_only_the_registry_lists_the_drafter_kinds():
    # the kinds are reached through the registry from above; a shared module importing a kind (or the registry)
    # would let one drafter reach another through it
    graph = _graph("runtime")
    kinds = {m for m in graph if m.startswith("runtime.drafters.") and m not in SHARED_DRAFTER_MODULES | {DRAFTER_REGISTRY}}
    assert [f"{m} imports {d}" for m in sorted(SHARED_DRAFTER_MODULES | kinds) for d in sorted(graph[m])
            if d == DRAFTER_REGISTRY or (m in SHARED_DRAFTER_MODULES and d in kinds)] == []


@pytest.mark.parametrize("packages", [("runtime",), ("export", "runtime")])
def test_no_import_circles(packages):
    assert cycles(_graph(*packages)) == []


def test_runtime_never_imports_the_workstation_side():
    graph = _graph("runtime", "export")
    assert [f"{m} imports {d}" for m, deps in sorted(graph.items()) if m.startswith("runtime")
            for d in sorted(deps) if d.startswith("export")] == []
