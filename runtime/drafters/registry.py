"""Every drafter kind, by the name a bundle entry gives it (bundle.yaml drafters.<name>.kind), and what the rest of
the runtime asks of a drafter entry: build it, its caches, its memory, the size of its largest verify forward.

Each kind declares these in its own file (runtime/drafters/<name>.py `SPEC`, a `DrafterSpec`); this is the one
module allowed to import every kind, and the only list of them. An entry's name is free (eagle3_chain, eagle2,
dflash_b8, mtp_numpy ...): its kind picks the spec. A new drafter is its runtime file plus one line in `SPECS`
(and its kind in runtime/model/bundle.py DRAFTER_KINDS, which tests/runtime/drafters/test_registry.py checks)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from runtime.config import BackendConfig
from runtime.drafters import dflash, draft_model, eagle, medusa, mtp, ngram
from runtime.drafters.base import Drafter, DrafterBuild, DrafterSpec
from runtime.errors import BundleError
from runtime.memory import plan as memory
from runtime.memory.kv import CacheShape, KVArena

SPECS: Tuple[DrafterSpec, ...] = (ngram.SPEC, draft_model.SPEC, mtp.SPEC, medusa.SPEC, eagle.SPEC, dflash.SPEC)
BY_KIND: Dict[str, DrafterSpec] = {kind: spec for spec in SPECS for kind in spec.kinds}
# Drafter names a session takes without a bundle entry (beside "none": plain decoding)
ENTRYLESS = tuple(kind for spec in SPECS if not spec.needs_entry for kind in spec.kinds)


def spec_of(kind: str) -> DrafterSpec:
    if kind not in BY_KIND:
        raise BundleError(f"drafter kind {kind!r} is not available in this runtime yet; it has {sorted(BY_KIND)}")
    return BY_KIND[kind]


def resolve(bundle, name: str) -> Optional[Tuple[DrafterSpec, Any, Any]]:
    """(spec, entry, typed params) of the bundle's drafter `name`; None for "none". An entry-less kind (ngram)
    without an entry gets its default params; any other name must be an entry of the bundle."""
    if name == "none":
        return None
    entry = bundle.drafters.get(name)
    if entry is None and name in ENTRYLESS:
        spec = BY_KIND[name]
        return spec, None, spec.params({}, f"drafter {name}")
    entry = bundle.drafter(name)  # a BundleError naming the bundle's drafters when it has no such entry
    spec = spec_of(entry.kind)
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
    return memory.bundle_cache_shapes(bundle, own)


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
                prefill_chunk: int = memory.PREFILL_CHUNK, exceed_max_positions: bool = False) -> memory.PlanInputs:
    """The memory plan's inputs for a bundle served with drafter `name` ("none": plain decoding) on `backend`,
    prefilling in chunks of `prefill_chunk` (and past max_position_embeddings only with `exceed_max_positions`)."""
    return memory.bundle_inputs(bundle, None if name == "none" else name, drafter_memory(bundle, name, backend),
                                backend, tree_tokens, precision, prefill_chunk, exceed_max_positions)
