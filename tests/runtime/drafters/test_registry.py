"""The drafter registry: every kind a bundle may name has one spec, declared in its own file, and the layers above
the drafters (session, memory plan, engine, certify) ask the registry and the Drafter interface, never the kind."""
from __future__ import annotations

import ast
import inspect
import os
import sys
import types

import pytest

from runtime.drafters import registry
from runtime.drafters.base import Drafter, DrafterSpec
from runtime.drafters.medusa import MedusaParams
from runtime.drafters.mtp import MTPDrafter
from runtime.errors import BundleError
from runtime.model import bundle as bundle_io
from tests.runtime.model.test_bundle import copy_bundle, read_manifest, write_manifest
from tests.support import REPO_ROOT

DRAFTER_KINDS = tuple(registry.BY_KIND)

# The files that once switched on drafter kinds (session.build_drafter, the plan's per-kind weights, certify's hasattr)
KIND_BLIND = ("runtime/serving/session.py", "runtime/serving/assembly.py", "runtime/memory/plan.py", "runtime/decode/engine.py",
              "runtime/certify/run.py", "runtime/commands/certify.py")
INTERFACE = {"branching", "fixed_shape", "builds_sampled_trees", "takes_branching", "model", "tree", "k"}


def test_every_file_of_the_drafters_package_but_the_shared_ones_is_a_kind_the_registry_found():
    files = {f[:-3] for f in os.listdir(os.path.join(REPO_ROOT, "runtime", "drafters"))
             if f.endswith(".py") and f != "__init__.py"}
    found = {inspect.getmodule(spec.build).__name__.rsplit(".", 1)[1] for spec in registry.SPECS}
    assert found == files - registry.NOT_KINDS
    assert sorted(registry.BY_KIND) == ["dflash", "dflash2", "draft_model", "eagle", "eagle3", "medusa", "mtp", "ngram"]


def _kind_module(monkeypatch, name, kinds):
    """A drafter file runtime/drafters/<name>.py declaring `kinds`, as the import system would find it."""
    module = types.ModuleType(f"runtime.drafters.{name}")
    module.SPEC = DrafterSpec(kinds=kinds, params=None, build=None, memory=None)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_new_drafter_file_is_a_kind_without_a_line_anywhere_else(monkeypatch):
    new = _kind_module(monkeypatch, "lookahead", ("lookahead",))
    specs = registry.discover(["ngram", "lookahead", "shared"])  # the order iter_modules gives is not kept
    assert [s.kinds for s in specs] == [("lookahead",), ("ngram",)] and specs[0] is new.SPEC


def test_two_files_declaring_one_kind_are_refused_at_import_naming_both(monkeypatch):
    _kind_module(monkeypatch, "lookahead", ("ngram",))
    with pytest.raises(ImportError, match=r"runtime/drafters/ngram\.py and runtime/drafters/lookahead\.py both declare kind 'ngram'"):
        registry.discover(["ngram", "lookahead"])


def test_an_unknown_kind_is_refused_naming_the_kinds_there_are():
    with pytest.raises(BundleError, match=r"'lookahead' unknown.*'eagle3'"):
        registry.spec_of("lookahead")


def test_a_bundle_entry_of_a_kind_no_drafter_declares_is_refused_when_resolved_naming_the_field(tiny_bundle, tmp_path):
    root = copy_bundle(tiny_bundle, tmp_path)
    m = read_manifest(root)
    m["drafters"]["ngram"]["kind"] = "lookahead"
    write_manifest(root, m)
    b = bundle_io.load(root)  # the bundle floor knows no kinds: a kind is the drafters' word
    with pytest.raises(BundleError, match=r"bundle\.yaml: drafters\.ngram\.kind 'lookahead' unknown.*'eagle3'"):
        registry.resolve(b, "ngram")


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


@pytest.mark.parametrize("name,flag", [("eagle3_chain", "--eagle3 DIR"), ("eagle2", "--eagle DIR"),
                                       ("medusa_chain", "--medusa PATH"), ("dflash2_b8", "--dflash DIR"),
                                       ("draft_model", "--draft DIR")])
def test_a_missing_drafter_says_which_bundle_flag_adds_it_from_its_kinds_own_file(tiny_bundle, name, flag):
    from dataclasses import replace

    b = bundle_io.load(tiny_bundle)
    b = b if name != "draft_model" else replace(b, drafters={})
    with pytest.raises(BundleError) as exc:
        registry.resolve(b, name)
    assert f"`edgespec bundle --target DIR {flag} --out {tiny_bundle} --force`" in str(exc.value), exc.value
    assert "it can run" in str(exc.value)  # and what the bundle runs instead


def test_the_longest_kind_a_name_starts_with_gives_its_source_and_a_kind_without_a_flag_says_where_it_comes_from():
    assert "--eagle3 DIR" in registry.how_to_add("eagle3_chain", "b")  # eagle3, not eagle
    assert "train-drafter dflash2" in registry.how_to_add("dflash2_b8", "b")  # dflash2, not dflash
    assert registry.how_to_add("mtp_numpy", "b").startswith("mtp_numpy comes from the target's own MTP module")
    assert registry.how_to_add("nope", "b") == ""
