"""The export side of the drafter registry (export/drafters/registry.py): every runtime drafter kind has its
export module and no export module lacks its runtime kind, and a kind's module dropped into
export/drafters/kinds/ is all it takes for `edgespec bundle`, `bundle add-drafter`, `train-drafter`, the bundle
build and the ONNX export to take it."""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import pytest

import runtime.drafters
from export.drafters import registry
from runtime.cli import build_parser
from runtime.model import bundle as bundle_io

FAKE = '''
import os
from export.drafters.registry import DrafterExport, Flag, Trainer

CALLS = []


def _add(writer, flag, path, spec):
    writer.add_drafter("fake", "fake", params={"source": os.path.basename(path)})
    CALLS.append(("add", flag, path))
    return ["fake"]


def _graphs(job):
    names = [n for n, d in job.bundle.drafters.items() if d.kind == "fake"]
    for n in names:
        with open(os.path.join(job.staging, f"drafter.{n}.fp32.onnx"), "w") as f:
            f.write("a graph")
    CALLS.append(("graphs", tuple(names)))
    return [(n, [f"onnx/drafter.{n}.fp32.onnx"], {"precision": "fp32"}) for n in names]


EXPORT = DrafterExport(kinds=("fake",), add=_add, graphs=_graphs, flags=(Flag("--fake", "a fake drafter"),),
                       trainers=(Trainer("fake", lambda args, target: (None, "nothing")),),
                       train_arguments=lambda p: p.add_argument("--fake-depth", type=int, default=1))
'''


def _modules_declaring(package, attribute: str):
    """{module name: kinds} of a package's modules that declare `attribute` (a SPEC or an EXPORT)."""
    out = {}
    for m in pkgutil.iter_modules(package.__path__):
        declared = getattr(importlib.import_module(f"{package.__name__}.{m.name}"), attribute, None)
        if hasattr(declared, "kinds"):
            out[m.name] = tuple(declared.kinds)
    return out


def test_every_runtime_drafter_kind_has_its_export_module_of_the_same_name_and_kinds_and_vice_versa():
    import export.drafters.kinds

    runtime_side = _modules_declaring(runtime.drafters, "SPEC")
    assert runtime_side and _modules_declaring(export.drafters.kinds, "EXPORT") == runtime_side
    assert {ex.module: ex.kinds for ex in registry.EXPORTS} == runtime_side


@pytest.fixture
def fake_kind(tmp_path, monkeypatch):
    """A module export/drafters/kinds/fake.py as a new drafter's author would drop it in (here in a folder added to
    the package's path), found by the registry's own discovery."""
    import export.drafters.kinds as kinds

    folder = tmp_path / "kinds"
    folder.mkdir()
    (folder / "fake.py").write_text(FAKE)
    monkeypatch.setattr(kinds, "__path__", list(kinds.__path__) + [str(folder)])
    monkeypatch.setattr(registry, "EXPORTS", registry.discover(m.name for m in pkgutil.iter_modules(kinds.__path__)))
    yield sys.modules["export.drafters.kinds.fake"]
    sys.modules.pop("export.drafters.kinds.fake", None)


def _subparser(parser, *path):
    for name in path:
        parser = next(a for a in parser._actions if getattr(a, "choices", None) and name in a.choices).choices[name]
    return parser


def test_a_new_kinds_module_puts_its_flag_on_bundle_and_add_drafter_and_its_trainer_and_flags_on_train_drafter(
        fake_kind):
    parser = build_parser()
    assert "--fake" in _subparser(parser, "bundle").format_help()
    assert "--fake" in _subparser(parser, "bundle", "add-drafter").format_help()
    train = _subparser(parser, "train-drafter")
    assert "fake" in train.format_help() and "--fake-depth" in train.format_help()


def test_a_new_kinds_module_adds_its_entry_when_the_bundle_is_built_and_exports_its_graph(fake_kind, tmp_path):
    from export.bundle.builder import build_bundle
    from export.onnx.bundle import add_onnx_to_bundle
    from tests.support.tiny_bundle import make_tokenizer, save_random_llama

    tok = str(tmp_path / "tokenizer.json")
    save_random_llama(str(tmp_path / "target"), make_tokenizer(tok), 1, 32, 0, tok)
    args = build_parser().parse_args(["bundle", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "b"),
                                      "--fake", str(tmp_path / "heads")])
    root = build_bundle(args.target, args.out, drafters=registry.given(args))
    assert bundle_io.load(root).drafters["fake"].params == {"source": "heads"}
    add_onnx_to_bundle(root, "fp32", validate=False)
    entry = bundle_io.load(root).drafters["fake"].backends["onnx"]
    assert list(entry.files) == ["onnx/drafter.fake.fp32.onnx"]
    assert open(os.path.join(root, entry.files[0])).read() == "a graph"
    assert fake_kind.CALLS == [("add", "--fake", str(tmp_path / "heads")), ("graphs", ("fake",))]


def test_the_kinds_modules_import_no_torch_so_the_cli_starts_without_it():
    import subprocess

    code = "import sys, export.drafters.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_every_trainer_kind_is_trained_end_to_end_by_the_any_target_test():
    from tests.export.drafters.test_any_target import KINDS

    assert sorted(KINDS) == sorted(registry.trainers())
