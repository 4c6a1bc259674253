"""The drafter registry: every kind a bundle may name has one spec, declared in its own file, and the layers above
the drafters (session, memory plan, engine, certify) ask the registry and the Drafter interface, never the kind."""
from __future__ import annotations

import ast
import inspect
import os

import pytest

from runtime.drafters import registry
from runtime.drafters.base import Drafter
from runtime.drafters.medusa import MedusaParams
from runtime.drafters.mtp import MTPDrafter
from runtime.errors import BundleError
from runtime.model.bundle import DRAFTER_KINDS
from tests.support import REPO_ROOT

# The files that once switched on drafter kinds (session.build_drafter, the plan's per-kind weights, certify's hasattr)
KIND_BLIND = ("runtime/serving/session.py", "runtime/memory/plan.py", "runtime/decode/engine.py",
              "runtime/certify/run.py", "runtime/commands/certify.py")
INTERFACE = {"branching", "fixed_shape", "builds_sampled_trees", "takes_branching", "model", "tree", "k"}


def test_every_bundle_kind_has_exactly_one_spec_and_the_registry_no_other():
    assert sorted(registry.BY_KIND) == sorted(DRAFTER_KINDS)
    kinds = [k for spec in registry.SPECS for k in spec.kinds]
    assert len(kinds) == len(set(kinds))


def test_an_unknown_kind_is_refused_naming_the_kinds_there_are():
    with pytest.raises(BundleError, match=r"'lookahead'.*'eagle3'"):
        registry.spec_of("lookahead")


def _kind_switches(path: str):
    """`x.kind == "..."` / `x.kind in (...)` comparisons and getattr/hasattr probes of the drafter interface."""
    tree = ast.parse(open(os.path.join(REPO_ROOT, path), encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            on_kind = any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides)
            literal = any(isinstance(s, ast.Constant) and s.value in DRAFTER_KINDS
                          or isinstance(s, (ast.Tuple, ast.List, ast.Set))
                          and any(isinstance(e, ast.Constant) and e.value in DRAFTER_KINDS for e in s.elts)
                          for s in sides)
            if on_kind and literal:
                found.append(f"{path}:{node.lineno} compares a kind")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in INTERFACE):
            found.append(f"{path}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


@pytest.mark.parametrize("path", KIND_BLIND)
def test_the_layers_above_the_drafters_never_switch_on_a_drafter_kind(path):
    assert _kind_switches(path) == []


def test_the_kind_switch_finder_sees_a_switch(tmp_path, monkeypatch):
    import tests.runtime.drafters.test_registry as me
    (tmp_path / "x.py").write_text('if entry.kind in ("eagle", "eagle3"):\n    w = getattr(d, "branching", 1)\n')
    monkeypatch.setattr(me, "REPO_ROOT", str(tmp_path))
    assert len(_kind_switches("x.py")) == 2


def _drafter_classes():
    import runtime.drafters as pkg
    seen = set()
    for spec in registry.SPECS:
        module = inspect.getmodule(spec.build)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Drafter) and cls is not Drafter and cls.__module__ == module.__name__:
                seen.add(cls)
    assert len(seen) == len(registry.SPECS), pkg
    return sorted(seen, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _drafter_classes(), ids=lambda c: c.__name__)
def test_every_drafter_begins_a_request_with_the_same_signature(cls):
    # the engine calls begin(prompt, taps, start=start) on every drafter, with no workaround per kind
    params = inspect.signature(cls.begin).parameters
    assert list(params)[:4] == ["self", "prompt", "taps", "start"] and params["start"].default == 0


def test_a_drafter_without_a_branching_knob_refuses_to_have_one_set():
    drafter = MTPDrafter.__new__(MTPDrafter)
    assert drafter.branching == 1 and not drafter.takes_branching
    with pytest.raises(ValueError, match="'mtp'"):
        drafter.set_branching(2)


def test_medusa_verifies_its_own_choice_list_whatever_the_branching_flag_says():
    medusa = registry.BY_KIND["medusa"]
    assert medusa.tree_tokens(MedusaParams(num_heads=4, tree="chain"), 6, 3) == 4 + 1  # 4 heads cap the chain
    assert medusa.tree_tokens(MedusaParams(num_heads=None, tree=[(0,), (1,), (0, 0)]), 2, 5) == 3 + 1
    assert registry.BY_KIND["draft_model"].tree_tokens(None, 4, 2) == 4 * 2 + 1
