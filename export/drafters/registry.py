"""Every drafter kind's export side, found as runtime/drafters/registry.py finds the runtime side: each module
export/drafters/kinds/<name>.py (the same name as its runtime/drafters/<name>.py) declares an `EXPORT`, a
`DrafterExport`, and the bundle CLI, the bundle builder and editor, the ONNX export and `edgespec
train-drafter` loop over them. A new drafter is its runtime file plus its kinds/ file, nothing else.

The kinds/ modules import no torch at their top (the bundle CLI reads their flags at every start); what they
run (the loaders, the graph exporters, the trainers) they import when it runs."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import export.drafters.kinds as package

# (drafter name, its files relative to the bundle, its backend entry's params): what a graph export records
Graph = Tuple[str, List[str], Dict[str, Any]]


@dataclass(frozen=True)
class Flag:
    """A flag of `edgespec bundle` and `edgespec bundle add-drafter` that adds a drafter from a path."""
    name: str  # "--eagle3"
    help: str
    metavar: str = "DIR"
    repeat: bool = False  # may be given several times (a list of paths)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class GraphJob:
    """What a drafter's ONNX export is given: the bundle (its drafters those of this export), the staging
    directory its graphs are written into (flat: the caller moves them into onnx/ by basename), the target's
    graph there (to share its vocab matrices) and weights, the precision asked for, whether to check, and whether
    K-step chain graphs are wanted (export/onnx/bundle.py's `kstep_wanted`)."""
    bundle: Any
    staging: str
    target_graph: str
    target_weights: Mapping[str, Any]
    precision: str
    validate: bool
    kstep: bool = False


@dataclass(frozen=True)
class Trainer:
    """`edgespec train-drafter <kind>`: how its task is made from the parsed flags and the loaded target."""
    kind: str
    task: Callable[[Any, Any], Tuple[Any, str]]  # (args, target) -> (task for the shared trainer, a shape line)
    out_files: Tuple[str, ...] = ("model.safetensors", "config.json")  # what it writes into --out
    check: Optional[Callable[[Any], None]] = None  # the kind's own flag checks (ConfigError), before any work
    config: Optional[Callable[..., Dict]] = None  # (args, task, target, heldout, say) -> extra config keys


@dataclass(frozen=True)
class DrafterExport:
    """One drafter kind as the export side sees it (export/drafters/kinds/<name>.py EXPORT)."""
    kinds: Tuple[str, ...]  # the bundle entry kinds it writes: the same as its runtime SPEC.kinds
    flags: Tuple[Flag, ...] = ()
    # (bundle writer, flag name, path given, target spec) -> the drafter names added to the bundle being written
    add: Optional[Callable[[Any, str, str, Any], List[str]]] = None
    always: Optional[Callable[[Any, Any], None]] = None  # (writer, target spec): the entry every bundle gets
    graphs: Optional[Callable[[GraphJob], List[Graph]]] = None  # its own ONNX graphs (float precisions)
    decoder_graph: bool = False  # its entries are decoder models: exported by the target's loop (K-step, quant)
    default: bool = False  # the bundle's default drafter when given (a separate draft model)
    trainers: Tuple[Trainer, ...] = ()
    train_arguments: Optional[Callable[[Any], None]] = None  # (train-drafter's parser): the kind's own flags
    module: str = ""  # its kinds/ module's name, set by `discover`


def discover(names: Iterable[str]) -> Tuple[DrafterExport, ...]:
    """The EXPORT of every module `export.drafters.kinds.<name>`, in name order; two claiming one kind, or one
    flag, are a programming error, refused at import."""
    found, kinds, flags = [], {}, {}
    for name in sorted(set(names)):
        ex = getattr(importlib.import_module(f"{package.__name__}.{name}"), "EXPORT", None)
        if not isinstance(ex, DrafterExport):
            continue
        for key, seen, what in [(k, kinds, "kind") for k in ex.kinds] + [(f.name, flags, "flag") for f in ex.flags]:
            if key in seen:
                raise ImportError(f"export/drafters/kinds/{name}.py and {seen[key]}.py both declare {what} {key!r}")
            seen[key] = name
        found.append(DrafterExport(**{**ex.__dict__, "module": name}))
    return tuple(found)


def by_kind(kind: str) -> Optional[DrafterExport]:
    return next((ex for ex in EXPORTS if kind in ex.kinds), None)


def is_decoder(kind: str) -> bool:
    """Whether entries of `kind` are decoder models, exported (ONNX, GGUF) as the target is."""
    ex = by_kind(kind)
    return ex is not None and ex.decoder_graph


def flags() -> List[Tuple[DrafterExport, Flag]]:
    return [(ex, f) for ex in EXPORTS for f in ex.flags]


def check_ranges(checks) -> None:
    """ConfigError for the first (flag, value, lo, hi) whose value is outside lo..hi."""
    from runtime.errors import ConfigError

    for flag, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise ConfigError(f"{flag}: got {value}, expected {lo}..{hi}")


def trainers() -> Dict[str, Trainer]:
    """{train-drafter kind: its trainer}, in the registry's order."""
    return {t.kind: t for ex in EXPORTS for t in ex.trainers}


def add_arguments(parser) -> None:
    """Every kind's bundle flags on `parser` (`edgespec bundle`, `bundle add-drafter`)."""
    for _, f in flags():
        if f.repeat:
            parser.add_argument(f.name, action="append", default=[], metavar=f.metavar, help=f.help)
        else:
            parser.add_argument(f.name, metavar=f.metavar, help=f.help)


def given(args) -> List[Tuple[str, str]]:
    """(flag, path) of every drafter flag set on parsed `args`, in the registry's order."""
    out = []
    for _, f in flags():
        value = getattr(args, f.dest, None)
        out += [(f.name, v) for v in (value if f.repeat else [value]) if v]
    return out


def add_given(writer, drafters: Sequence[Tuple[str, str]], target_spec) -> List[str]:
    """Add each (flag, path) to the bundle being written by `writer`; returns the drafter names added."""
    owner = {f.name: ex for ex, f in flags()}
    added: List[str] = []
    for flag, path in drafters:
        if flag not in owner:
            raise ValueError(f"{flag}: no drafter kind declares this flag (export/drafters/kinds/)")
        added += owner[flag].add(writer, flag, path, target_spec)
    return added


def graphs(job: GraphJob) -> List[Graph]:
    """Every drafter graph of the job's bundle that its kind exports itself, written into job.staging."""
    return [g for ex in EXPORTS if ex.graphs is not None for g in ex.graphs(job)]


# Last: the kinds' modules import this module's types and helpers (check_ranges) while it is imported
EXPORTS: Tuple[DrafterExport, ...] = discover(m.name for m in pkgutil.iter_modules(package.__path__))
