"""What `edgespec tune` measured, kept in the bundle as `tune.yaml`, and the adaptive policy a Session builds from it.

A tune belongs to one machine, backend and precision: the verify cost of n rows and each drafter's cost and
acceptance depend on all three. `tune.yaml` holds a list of such entries; a Session uses the entry of its own
machine (fingerprint: architecture, CPU model, cores, memory) and reports one from another machine instead of
using it. The file is not part of the sealed manifest (it is a measurement, not weights) and is replaced
atomically, one entry at a time.

    tunes:
    - backend: onnx
      precision: fp32
      machine: {id: 3f2a..., arch: x86_64, cpu: AMD EPYC ..., cores: 2, memory_gb: 24}
      when: '2026-12-01T22:10:00Z'
      verify: [[1, 0.0051], [2, 0.0056], ...]      # seconds of one verify forward of n rows
      drafters:
        draft_model:
          draft_fixed: 0.0004                        # seconds per cycle that drafts, plus ...
          draft_per_node: 0.0012                     # ... seconds per drafted node
          k_max: 8
          templates: {planner/greedy: {alphas: [0.93, 0.9, ...], k: 6, speedup: 2.1}, ...}
          calibration:                               # acceptance against the drafter's path confidence
            greedy: {edges: [0.0, 0.02, ...], drafted: [310, ...], accepted: [12, ...]}
            sampled: {...}
"""
from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import yaml

from runtime.errors import BundleError
from runtime.model.bundle import TUNE_FILE
from runtime.speculation import AcceptanceTracker, AdaptivePolicy, Calibration, CostModel, default_cost

SHAPES = ("auto", "fixed", "adaptive")


def machine_fingerprint() -> Dict[str, object]:
    """What makes one machine's costs differ from another's, and a short id of it."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory_gb = 0.0
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            memory_gb = round(int(f.readline().split()[1]) / 2**20)
    except (OSError, ValueError, IndexError):
        pass
    info = {"arch": platform.machine(), "cpu": cpu, "cores": os.cpu_count() or 0, "memory_gb": memory_gb}
    info["id"] = hashlib.sha256(repr(sorted(info.items())).encode()).hexdigest()[:12]
    return info


def read_tunes(bundle_dir: str) -> List[dict]:
    path = os.path.join(bundle_dir, TUNE_FILE)
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        tunes = data.get("tunes", [])
        if not isinstance(tunes, list) or not all(isinstance(t, dict) for t in tunes):
            raise ValueError("`tunes` is not a list of mappings")
        return tunes
    except (OSError, yaml.YAMLError, ValueError, AttributeError) as exc:
        why = " ".join(str(exc).split())  # YAML errors span lines; the operator gets one
        raise BundleError(f"{path}: unreadable tune ({why}); delete it and run `edgespec tune --bundle {bundle_dir}` "
                          "again") from None


def write_tune(bundle_dir: str, entry: dict) -> str:
    """Put `entry` into the bundle's tune.yaml in place of the one for the same backend, precision and machine
    (others are kept), atomically. Returns the file's path."""
    tunes = [t for t in read_tunes(bundle_dir) if _slot(t) != _slot(entry)] + [entry]
    path = os.path.join(bundle_dir, TUNE_FILE)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".yaml", dir=bundle_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yaml.safe_dump({"tunes": tunes}, f, sort_keys=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _slot(entry: dict) -> Tuple:
    return entry.get("backend"), entry.get("precision"), (entry.get("machine") or {}).get("id")


@dataclass(frozen=True)
class ShapeChoice:
    """How a Session drafts: `policy` None = the drafter's fixed shape; `label` is what stats and logs say."""
    policy: Optional[AdaptivePolicy]
    num_tokens: int  # the drafter's own depth (the adaptive budget never exceeds it)
    label: str
    note: str = ""  # one line for the operator (e.g. a tune from another machine was not used)


def choose_shape(shape: str, bundle_dir: str, backend: str, precision: str, drafter: str,
                 num_tokens: int) -> ShapeChoice:
    """`drafter.shape`: fixed -> the drafter's own shape; adaptive -> the rule of runtime/speculation.py with this
    machine's tune when there is one (else costs learnt while running); auto -> adaptive where a tune of this
    machine, backend and precision covers the drafter, fixed otherwise."""
    if shape not in SHAPES:
        raise BundleError(f"drafter.shape: got {shape!r}, expected one of {list(SHAPES)}")
    if drafter == "none" or shape == "fixed":
        return ShapeChoice(None, num_tokens, "fixed")
    tunes = [t for t in read_tunes(bundle_dir) if t.get("backend") == backend and t.get("precision") == precision]
    me = machine_fingerprint() if tunes else {}
    mine = next((t for t in tunes if (t.get("machine") or {}).get("id") == me["id"]), None)
    note = ""
    if mine is None and tunes:
        other = tunes[-1].get("machine") or {}
        note = (f"{os.path.join(bundle_dir, TUNE_FILE)} holds a tune for {other.get('cpu', '?')} "
                f"({other.get('cores', '?')} cores), not this machine ({me['cpu']}, {me['cores']} cores): not used; "
                f"run `edgespec tune --bundle {bundle_dir} --backend {backend}` here")
    tuned = (mine or {}).get("drafters", {}).get(drafter)
    if tuned is None:
        if shape == "auto":
            return ShapeChoice(None, num_tokens, "fixed", note)
        return ShapeChoice(AdaptivePolicy(default_cost(), num_tokens, learn_costs=True), num_tokens, "adaptive", note)
    cost = CostModel(tuple((int(n), float(s)) for n, s in mine["verify"]), float(tuned.get("draft_fixed", 0.0)),
                     float(tuned.get("draft_per_node", 0.0)))
    k_max = int(tuned.get("k_max", num_tokens))
    policy = AdaptivePolicy(cost, k_max, first_probe_from_cost=True)  # a probe's cost is known: no early one
    for key, t in (tuned.get("templates") or {}).items():  # the tune's acceptance is the starting belief
        policy.trackers[key] = seeded_tracker(t.get("alphas") or [], t.get("cycles", 8))
    where = f"{os.path.join(bundle_dir, TUNE_FILE)}: drafters.{drafter}.calibration"
    for cls, table in (tuned.get("calibration") or {}).items():  # ... and so is its confidence calibration
        try:
            policy.calibrations[cls] = Calibration.from_dict(table, f"{where}.{cls}")
        except ValueError as exc:
            raise BundleError(f"{exc}; run `edgespec tune --bundle {bundle_dir}` again") from None
    return ShapeChoice(policy, k_max, "adaptive (tuned)", note)


def seeded_tracker(alphas: List[float], cycles: float) -> AcceptanceTracker:
    """A tracker that starts as if it had seen `cycles` cycles with these conditional acceptances.

    >>> [round(a, 3) for a in seeded_tracker([0.9, 0.5], 10).alphas(2)]
    [0.9, 0.5]"""
    t = AcceptanceTracker(prior=alphas[0] if alphas else 0.5, prior_weight=0.0)
    reach = float(cycles)
    for a in alphas:
        t.reached.append(reach)
        t.hit.append(reach * float(a))
        reach *= float(a)
        if reach <= 1e-6:
            break
    return t


TASK_VALUES = ("instruction", "context", "observation", "text")


def template_prefixes(fmt, encode) -> List[Tuple[str, Tuple[int, ...]]]:
    """[(task, token ids every prompt of that task starts with)], longest first: the common start of the task's
    prompt rendered with two unlike sets of request values, tokenized. Tasks that start alike share one name
    ("action|planner"), since no prompt can tell them apart by its start."""
    found: Dict[Tuple[int, ...], List[str]] = {}
    for task in sorted(fmt.tasks):
        try:
            a, b = (encode(fmt.render(task, **{k: v for k in TASK_VALUES})) for v in ("alpha", "Zulu 9;"))
        except Exception:  # noqa: BLE001 - a template that cannot render this way is simply not recognised
            continue
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        if n:
            found.setdefault(tuple(int(t) for t in a[:n]), []).append(task)
    return sorted((("|".join(v), k) for k, v in found.items()), key=lambda e: -len(e[1]))


def template_of(prompt_ids, prefixes: List[Tuple[str, Tuple[int, ...]]]) -> Optional[str]:
    """The task whose fixed start the prompt begins with (the longest such), else None.

    >>> template_of([1, 3, 9, 9], [("planner", (1, 3)), ("text", (1,))])
    'planner'
    >>> template_of([2, 3], [("planner", (1, 3))]) is None
    True"""
    head = tuple(int(t) for t in prompt_ids[:max((len(p) for _, p in prefixes), default=0)])
    for name, ids in prefixes:
        if head[:len(ids)] == ids:
            return name
    return None
