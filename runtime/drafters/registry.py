"""Every drafter kind, by the name a bundle entry gives it (bundle.yaml drafters.<name>.kind), and what the rest of
the runtime asks of a drafter entry: build it, its caches, its memory, the size of its largest verify forward.

Each kind declares these in its own file (runtime/drafters/<name>.py `SPEC`, a `DrafterSpec`), and this module
finds them: every module of the package that declares a SPEC is a kind, so a new drafter is its runtime file and
nothing else here. The bundle loader (a floor below) takes any kind name; `resolve` refuses one no file declares.
An entry's name is free (eagle3_chain, eagle2, dflash_b8, mtp_numpy ...): its kind picks the spec."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import runtime.drafters as package
from runtime.config import BackendConfig
from runtime.drafters.base import Drafter, DrafterBuild, DrafterSpec
from runtime.drafters.shared import kstep_runs
from runtime.errors import BundleError
from runtime.memory import bundle_sizes, plan as memory
from runtime.memory.kv import CacheShape, KVArena

# The package's modules that are not a kind: the interface, the shared pieces and this list.
NOT_KINDS = frozenset({"base", "shared", "heads", "registry"})


def discover(names: Iterable[str]) -> Tuple[DrafterSpec, ...]:
    """The SPEC of every module `runtime.drafters.<name>` that declares one, in name order; two specs claiming
    one kind are a programming error, refused here (at import) rather than one silently winning."""
    specs, owner = [], {}
    for name in sorted(set(names) - NOT_KINDS):
        spec = getattr(importlib.import_module(f"{package.__name__}.{name}"), "SPEC", None)
        if not isinstance(spec, DrafterSpec):
            continue
        for kind in spec.kinds:
            if kind in owner:
                raise ImportError(f"runtime/drafters/{name}.py and {owner[kind]}.py both declare kind {kind!r}")
            owner[kind] = f"runtime/drafters/{name}"
        specs.append(spec)
    return tuple(specs)


SPECS: Tuple[DrafterSpec, ...] = discover(m.name for m in pkgutil.iter_modules(package.__path__))
BY_KIND: Dict[str, DrafterSpec] = {kind: spec for spec in SPECS for kind in spec.kinds}
# Drafter names a session takes without a bundle entry (beside "none": plain decoding)
ENTRYLESS = tuple(kind for spec in SPECS if not spec.needs_entry for kind in spec.kinds)


def spec_of(kind: str, where: str = "drafter kind") -> DrafterSpec:
    """The spec of `kind`; `where` names the field that gave it (the manifest's drafters.<name>.kind)."""
    if kind not in BY_KIND:
        raise BundleError(f"{where} {kind!r} unknown: this runtime has the drafter kinds {sorted(BY_KIND)}; "
                          "use one of them, or a runtime whose runtime/drafters/ declares it")
    return BY_KIND[kind]


def how_to_add(name: str, root: str) -> str:
    """How to give the bundle at `root` the drafter `name`, from the kind its name starts with (the longest: an
    entry's name is its kind or the kind plus a suffix, eagle3_chain, dflash2_b8); "" for a name no kind makes.

    Example: how_to_add("eagle3_chain", "b") -> "add it by rebuilding the bundle with
    `edgespec bundle --target DIR --eagle3 DIR --out b --force` (--eagle3 takes a head from ...)"."""
    kinds = [k for spec in SPECS for k in spec.sources if name.startswith(k)]
    if not kinds:
        return ""
    kind = max(kinds, key=len)
    flag, what = BY_KIND[kind].sources[kind]
    if flag is None:
        return f"{name} comes from {what}"
    return (f"add it by rebuilding the bundle with `edgespec bundle --target DIR {flag} --out {root} "
            f"--force` ({flag.split()[0]} takes {what})")


def missing_drafter(bundle, name: str) -> str:
    """The bundle's message for a drafter it lacks (what it can run instead), and how to add that one."""
    how = how_to_add(name, bundle.root)
    return bundle.missing_drafter(name) + (f"; {how}" if how else "")


def resolve(bundle, name: str) -> Optional[Tuple[DrafterSpec, Any, Any]]:
    """(spec, entry, typed params) of the bundle's drafter `name`; None for "none". An entry-less kind (ngram)
    without an entry gets its default params; any other name must be an entry of the bundle."""
    if name == "none":
        return None
    entry = bundle.drafters.get(name)
    if entry is None and name in ENTRYLESS:
        spec = BY_KIND[name]
        return spec, None, spec.params({}, f"drafter {name}")
    if entry is None:
        raise BundleError(missing_drafter(bundle, name))
    spec = spec_of(entry.kind, f"{bundle.path('bundle.yaml')}: drafters.{name}.kind")
    return spec, entry, spec.params(entry.params, f"{bundle.path('bundle.yaml')}: drafters.{name}.params")


def build_drafter(name: str, bundle, backend: BackendConfig, arena: KVArena, max_positions: int, num_tokens: int,
                  branching: int, target_weights: Optional[Mapping] = None) -> Optional[Drafter]:
    """The drafter `name` of the bundle, its caches allocated in `arena`; None for "none"."""
    found = resolve(bundle, name)
    if found is None:
        return None
    spec, entry, params = found
    return spec.build(DrafterBuild(name, entry, bundle, backend, arena, max_positions, num_tokens, branching,
                                   target_weights), params)


def cache_shapes(bundle, name: str) -> Dict[str, CacheShape]:
    """Every cache a Session with this drafter allocates: the target's and the drafter's."""
    found = resolve(bundle, name)
    own = {} if found is None else found[0].cache_shapes(found[1], found[2], bundle.target.spec)
    return bundle_sizes.bundle_cache_shapes(bundle, own)


def tree_tokens(bundle, name: str, num_tokens: int, branching: int) -> int:
    """Tokens of the largest verify forward (the root included) with this drafter and these flags."""
    found = resolve(bundle, name)
    if found is None:
        return num_tokens * branching + 1
    return found[0].tree_tokens(found[2], num_tokens, branching)


def drafter_memory(bundle, name: str, backend: str) -> memory.DrafterMemory:
    found = resolve(bundle, name)
    if found is None or found[1] is None:
        return memory.NO_DRAFTER
    spec, entry, params = found
    return spec.memory(bundle, entry, params, backend)


def plan_inputs(bundle, name: str, backend: str, tree_tokens: int, precision: str = "auto",
                prefill_chunk: int = memory.PREFILL_CHUNK, exceed_max_positions: bool = False,
                providers: Optional[Tuple[str, ...]] = None, branching: int = 1) -> memory.PlanInputs:
    """The memory plan's inputs for a bundle served with drafter `name` ("none": plain decoding) on `backend`,
    prefilling in chunks of `prefill_chunk` (and past max_position_embeddings only with `exceed_max_positions`).
    A drafter's K-step graph is counted where it runs on these execution `providers` (shared.kstep_runs); None:
    a robot's, where a GPU provider takes it unless the entry says kstep "off" (the memory CLI plans a device);
    never for `branching` > 1 split chains of a drafter whose graph drafts one chain (it is not opened then)."""
    draft = drafter_memory(bundle, name, backend)
    inputs = bundle_sizes.bundle_inputs(bundle, None if name == "none" else name, draft, backend, tree_tokens,
                                        precision, prefill_chunk, exceed_max_positions)
    runs = draft.kstep_mode != "off" if providers is None else \
        kstep_runs(draft.kstep_mode, BackendConfig(kind=backend, providers=tuple(providers)))
    runs = runs and not (draft.kstep_chain_only and branching > 1)
    return replace(inputs, drafter_kstep_bytes=draft.kstep_bytes if draft.kstep_bytes and runs else 0)
