"""Typed configuration: YAML in, frozen dataclasses out, validated once at load.

Every field may carry limits in its metadata (`min`, `max`, `choices`); a bad value raises a
ConfigError naming the file, the key path, the value and what was expected."""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple, Type, TypeVar

import yaml

from runtime.errors import ConfigError

T = TypeVar("T")


def limits(default: Any = dataclasses.MISSING, *, min=None, max=None, choices=None, doc: str = ""):
    """A dataclass field with validation limits (min/max inclusive, or a set of choices)."""
    meta = {"min": min, "max": max, "choices": choices, "doc": doc}
    if isinstance(default, (list, dict, tuple)) and not isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class MemoryConfig:
    budget_mb: float = limits(0.0, min=0.0, doc="MiB the whole process may hold (weights, KV, scratch, runtime: "
                                                "runtime/memory/plan.py plans it); the KV arena gets what is left; "
                                                "0 = no budget, size the arena from max_context")
    max_context: int = limits(2048, min=16, max=1 << 20,
                              doc="positions the KV cache holds per model; at most the target's max_position_embeddings "
                                  "(this default is cut to it, a larger value given is refused) unless "
                                  "exceed_max_position_embeddings")
    exceed_max_position_embeddings: bool = limits(
        False, doc="let max_context (and the memory plan) go past the target's max_position_embeddings, the context "
                   "it was trained for (rope positions it never saw: the output degrades, nothing fails)")
    prefill_chunk: int = limits(512, min=1, max=1 << 20,
                                doc="tokens per prefill forward: a longer prompt runs as several forwards (exact), "
                                    "so its scratch (activations, attention scores, logits) is one chunk's")
    prefix_cache: bool = limits(True, doc="keep the K/V rows of the prompt prefix a request shares with the previous "
                                          "one (exact: same tokens, same positions) and prefill only the rest")


@dataclass(frozen=True)
class BackendConfig:
    # auto = onnx where onnxruntime is installed and the bundle has ONNX graphs, else numpy_ref (the slow,
    # exact oracle: name it to compare against it).
    kind: str = limits("auto", choices=("numpy_ref", "onnx", "gguf", "tensorrt", "auto"))
    threads: int = limits(0, min=0, max=256, doc="0 = one per CPU core")
    # "run" by default: on a quiet 2-core CPU a zoo step took 1.06 ms with it and 1.73 ms with "never" (BENCHMARKS
    # N3/N2); "never" is the choice where other processes oversubscribe the cores (docs/backends/onnx.md)
    spinning: str = limits("run", choices=("never", "run", "always"),
                           doc="onnx: ORT's intra-op threads sleep between operators (never), spin while a run lasts "
                               "(run: no wake-up per operator, idle between runs) or also after it (always, ORT's "
                               "default); spinning pays on dedicated cores only")
    providers: Tuple[str, ...] = ("CPUExecutionProvider",)
    precision: str = limits("auto", choices=("auto", "fp32", "fp16", "int8", "int4", "f16", "q8_0", "q4_K_M"),
                            doc="which target of the bundle runs. onnx: auto = its float graph (fp32 or fp16); "
                                "int8 / int4 = the weight-only quantised graph, which then IS the target. gguf: "
                                "f16 | q8_0 | q4_K_M (or fp16 | int8 | int4), auto = the most precise it holds")
    cuda_graphs: bool = limits(False, doc="tensorrt: replay decode/verify steps as CUDA graphs (past padded to "
                                          "64-row buckets); prefills run eagerly")
    # Batch-1 gemv on shared cores is fastest single-threaded (see runtime/serving/blas.py); 0 = numpy's default.
    blas_threads: int = limits(1, min=0, max=256, doc="numpy BLAS threads for the numpy backend and drafters")


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = limits("auto", doc="auto = the bundle's default; none = plain decoding; or a drafter in the bundle")
    num_tokens: int = limits(4, min=1, max=64, doc="draft depth (tokens proposed per cycle along one branch)")
    branching: int = limits(1, min=1, max=16, doc="children per tree node (1 = a chain)")
    shape: str = limits("auto", choices=("auto", "fixed", "adaptive"),
                        doc="fixed = the drafter's own shape every cycle; adaptive = each cycle's node budget from "
                            "the measured cost model and the acceptance so far (never planned slower than plain "
                            "decoding); auto = adaptive where `edgespec tune` measured this machine, else fixed")


@dataclass(frozen=True)
class DecodingConfig:
    lossy_typical_acceptance: bool = limits(
        False, doc="LOSSY: accept sampled drafts by Medusa's typical acceptance (runtime/verify_typical.py) instead "
                   "of exact rejection sampling; changes the output distribution; greedy stays exact; certify refuses it")
    typical_epsilon: float = limits(0.09, min=0.0, max=1.0,
                                    doc="typical acceptance: the hard threshold (Medusa's posterior_threshold)")
    typical_delta: float = limits(0.3, min=0.0, max=1.0,
                                  doc="typical acceptance: the entropy-scaled threshold (Medusa's posterior_alpha)")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = limits(128, min=1, max=1 << 20)
    temperature: float = limits(0.0, min=0.0, max=100.0)
    top_k: int = limits(0, min=0)
    top_p: float = limits(1.0, min=1e-9, max=1.0)
    min_p: float = limits(0.0, min=0.0, max=0.999999)
    repetition_penalty: float = limits(1.0, min=1e-6, max=100.0)
    seed: int = limits(0, min=0)
    stop: Tuple[str, ...] = ()


@dataclass(frozen=True)
class RuntimeConfig:
    bundle: str = limits("build/bundles/zoo", doc="bundle directory")
    backend: BackendConfig = BackendConfig()
    drafter: DrafterConfig = DrafterConfig()
    memory: MemoryConfig = MemoryConfig()
    decoding: DecodingConfig = DecodingConfig()
    generation: GenerationConfig = GenerationConfig()


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gb: float = limits(8.0, min=0.1)
    bandwidth_gbs: float = limits(68.0, min=0.1)
    reserved_mb: float = limits(800.0, min=0.0, doc="memory the OS/desktop keeps (read MemAvailable on the device)")
    notes: str = ""


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _convert(value, inner, where, source)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, where)
    if origin in (tuple, Tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected a list")
        elem = args[0] if args else Any
        return tuple(_convert(v, elem, f"{where}[{i}]", source) for i, v in enumerate(value))
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected a mapping")
        return {str(k): _convert(v, args[1], f"{where}.{k}", source) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {where}: got {value!r}, expected a string")
        return value
    raise ConfigError(f"{source}: {where}: cannot check type {_type_name(tp)}")


def from_dict(cls: Type[T], data: Any, source: str = "<config>", where: str = "") -> T:
    """Build the frozen dataclass `cls` from a mapping, validating keys, types and limits."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or '<top>'}: got {data!r}, expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"{source}: {key}: unknown key; expected one of {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{source}: {key}: missing required key")
            continue
        values[name] = _checked(f, hints[name], data[name], key, source)
    return cls(**values)


def _checked(f: dataclasses.Field, tp: Any, raw: Any, key: str, source: str) -> Any:
    """`raw` converted to the field's type and checked against its limits, or a ConfigError."""
    value = _convert(raw, tp, key, source)
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{source}: {key}: got {value!r}, expected one of {list(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{source}: {key}: got {value!r}, expected >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{source}: {key}: got {value!r}, expected <= {meta['max']}")
    return value


def override(cfg: T, key_path: str, value: Any, source: str = "command line") -> T:
    """`cfg` with the field at `key_path` ("memory.max_context") set to `value`, checked by exactly the
    rules a YAML value meets. `source` names where the value came from: the flag --max-context gives
    `--max-context: memory.max_context: got 2000000, expected <= 1048576`."""
    return _override(cfg, key_path.split("."), value, source, key_path)


def _override(cfg: Any, names: list, value: Any, source: str, key_path: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if names[0] not in fields:
        raise ConfigError(f"{source}: {key_path}: unknown key; expected one of {sorted(fields)}")
    if len(names) > 1:
        return dataclasses.replace(cfg, **{names[0]: _override(getattr(cfg, names[0]), names[1:], value, source,
                                                                key_path)})
    tp = typing.get_type_hints(type(cfg))[names[0]]
    return dataclasses.replace(cfg, **{names[0]: _checked(fields[names[0]], tp, value, key_path, source)})


def load_yaml(path: str) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file") from exc


def load_config(path: str, cls: Type[T] = RuntimeConfig) -> T:  # type: ignore[assignment]
    """Load a YAML file into `cls` (RuntimeConfig by default)."""
    return from_dict(cls, load_yaml(path), source=path)


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj
