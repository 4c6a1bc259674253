"""`edgespec export --to tensorrt`: TensorRT engines built from a bundle's ONNX graphs, on the device that will
run them (an engine is tied to its GPU and TensorRT version), with the TensorRT builder API.

Per model (the target, and each draft model that has an ONNX graph) one engine, `tensorrt/<model>.engine`:
- parsed from the model's ONNX graph (export/onnx/graph.py) into a STRONGLY TYPED network where TensorRT has the
  flag: the graph's own types decide each layer's precision, so an fp16 export gives fp16 weights, activations
  and KV with its norms and softmax kept in float32, exactly as ONNX Runtime runs it (a weakly typed fp16 build
  may demote those to half). An fp32 graph builds an fp32 engine.
- two optimisation profiles (runtime/backends/tensorrt_plan.engine_profiles): verify (T <= --verify-tokens)
  and prefill (T <= --prefill-tokens, default 512: longer prompts run in chunks), both over caches of
  --max-context + DRAFT_SLACK rows;
- the KV cache as explicit I/O (past_key_i in, new_key_i out), bound by the runtime into its one device arena.
One timing cache for the bundle (`tensorrt/timing.cache`) is loaded and saved across builds, so a rebuild on the
same device skips most kernel timing. Every engine is written to a temporary file and renamed into place only
after all builds succeeded; then bundle.yaml (atomically rewritten) lists the files with their checksums and
records, per engine, the TensorRT version, the GPU and compute capability, the L4T / JetPack release, the
profiles and the source graph's checksum. The runtime refuses an engine whose versions do not match the machine.

Weight-only int8 / int4 (`--lossy-weights`, lossy: a quantized target is another target): TensorRT takes them as
DequantizeLinear nodes on the weights of a strongly typed network (it does not quantize weights itself), so the
graph is rewritten first (export/tensorrt/quantize.py: int8 per output column, int4 in blocks of 128 input rows) into a
scratch copy the engine is built from; the bundle's ONNX graph is left as it is."""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from runtime.model import bundle as bundle_mod
from runtime.drafters import registry
from runtime.memory import plan as memory
from runtime.backends.tensorrt import import_cudart, import_tensorrt, machine_facts
from runtime.backends.tensorrt_plan import KV_LAYOUT, Profile, engine_profiles, profiles_to_params
from runtime.errors import BackendError, BundleError

ENGINE_DIR = "tensorrt"
TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"
MIN_TENSORRT = (10, 0)  # named I/O tensors, execute_async_v3, strongly typed networks, int64 I/O
# The prefill profile's largest forward: a longer prompt runs as causal chunks of this (runtime/backends/tensorrt.py),
# which bounds the activation memory (attention scores grow with T x context).
PREFILL_TOKENS = 512


def engine_path(model: str) -> str:
    """Bundle-relative engine file of a model: "target" -> tensorrt/target.engine,
    drafter "draft_model" -> tensorrt/drafter.draft_model.engine."""
    return f"{ENGINE_DIR}/target.engine" if model == "target" else f"{ENGINE_DIR}/drafter.{model}.engine"


def check_tensorrt_version(version: str) -> None:
    """Refuse a TensorRT older than MIN_TENSORRT, naming what was found and what to install."""
    try:
        found = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        raise BackendError(f"TensorRT reports version {version!r}, which edgespec cannot read; "
                           "install TensorRT 10 or later") from None
    if found < MIN_TENSORRT:
        raise BackendError(f"TensorRT {version} is too old: edgespec builds engines with the TensorRT "
                           f"{MIN_TENSORRT[0]} API (named I/O tensors, execute_async_v3); JetPack 6.1+ ships TensorRT 10.3")


def write_bytes_atomically(path: str, data: bytes) -> None:
    """`path` replaced by `data`: written and flushed to a temporary sibling, then renamed, so a reader (or a
    crash) sees the old file or the new one, never half an engine."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        bundle_mod.give_normal_mode(tmp)  # mkstemp made it 0o600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def engine_params(onnx_params: Mapping, source: str, source_sha256: str, profiles: Sequence[Profile],
                  facts: Mapping[str, object], strongly_typed: bool, lossy_weights: Optional[str] = None
                  ) -> Dict[str, object]:
    """What bundle.yaml records of one engine (target.backends.tensorrt.params): what the runtime needs to bind
    it (precision = its KV dtype, taps, layout, profiles) and what ties it to this machine (versions)."""
    return {"precision": onnx_params.get("precision", "fp32"), "taps": list(onnx_params.get("taps", [])),
            "kv_layout": KV_LAYOUT, "profiles": profiles_to_params(profiles), "source": source,
            "source_sha256": source_sha256, "strongly_typed": strongly_typed, "lossy_weights": lossy_weights,
            **{k: facts.get(k) for k in ("tensorrt_version", "device_name", "compute_capability", "l4t_version",
                                        "jetpack_version")}}


def context_rows(bundle, max_context: Optional[int], budget: Optional[int], verify_tokens: int) -> int:
    """Cache rows the engines are built for: --max-context, or the longest context the memory plan fits in
    --budget for this bundle on TensorRT (with its default drafter), plus the rows a drafter drafts into."""
    if max_context is None and budget is None:
        max_context = 2048  # memory.max_context's default
    if budget is not None:
        # The engines keep the ONNX graph's precision; the process carries a CUDA context and TensorRT's runtime.
        # (TensorRT engines never run a drafter's K-step ONNX graph: no such row)
        inputs = replace(registry.plan_inputs(bundle, bundle.default_drafter, "onnx", verify_tokens),
                         overhead_bytes=memory.RUNTIME_OVERHEAD["tensorrt"], drafter_kstep_bytes=0)
        fit = memory.max_context(inputs, budget)
        if fit < memory.MIN_CONTEXT:
            raise BundleError(memory.over_budget(inputs, budget, memory.MIN_CONTEXT, "this bundle"))
        max_context = fit if max_context is None else min(max_context, fit)
    return int(max_context) + memory.DRAFT_SLACK


def build_engine(trt, onnx_path: str, profiles: Sequence[Profile], timing_cache: bytes, workspace_bytes: int
                 ) -> Tuple[bytes, bytes, bool]:
    """(serialized engine, serialized timing cache, strongly typed) for one ONNX graph. Raises BackendError with
    the parser's or builder's own messages."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):  # reads the external .data beside the graph
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendError(f"{onnx_path}: TensorRT's ONNX parser refused the graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    for p in profiles:  # index order = tensorrt_plan.PROFILE_NAMES, as the runtime selects them
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    cache = config.create_timing_cache(timing_cache)
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BackendError(f"{onnx_path}: TensorRT could not build an engine (see its log above); a smaller "
                           "--max-context / --prefill-tokens or a larger --workspace-mb may help")
    return bytes(serialized), bytes(config.get_timing_cache().serialize()), strongly_typed


def _models(b) -> List[Tuple[str, object, str, Mapping]]:
    """(model name, spec, bundle-relative ONNX graph, onnx params) of every model with an ONNX entry."""
    target = b.target.backends.get("onnx")
    if target is None:
        raise BundleError(f"{b.root}: the target has no ONNX graph to build engines from; run "
                          f"`edgespec export --to onnx --bundle {b.root} --precision fp16 --attention matmul` first")
    out = [("target", b.target.spec, _graph(b, "target", target), target.params)]
    for name, d in b.drafters.items():
        entry = d.backends.get("onnx")
        if entry is not None and d.spec is not None:
            out.append((name, d.spec, _graph(b, f"drafter {name}", entry), entry.params))
    return out


def _graph(b, label: str, entry) -> str:
    if entry.params.get("attention", "matmul") != "matmul":  # a com.microsoft op TensorRT's parser does not know
        raise BundleError(f"{b.root}: the {label}'s ONNX graph uses ONNX Runtime's GroupQueryAttention "
                          f"(--attention {entry.params['attention']}); engines are built from the matmul graphs: "
                          f"`edgespec export --to onnx --bundle {b.root} --precision fp16 --attention matmul`")
    graphs = [f for f in entry.files if f.endswith(".onnx")]
    if not graphs:
        raise BundleError(f"{b.root}: the ONNX entry of the {label} lists no .onnx graph; re-export it with "
                          f"`edgespec export --to onnx --bundle {b.root} --precision fp16 --attention matmul`")
    return graphs[0]


def _refuse_unlisted(bundle_dir: str, rels: Sequence[str], listed: set) -> None:
    for rel in rels:
        if os.path.exists(os.path.join(bundle_dir, rel)) and rel not in listed:
            raise BundleError(f"{bundle_dir}/{rel}: exists but bundle.yaml does not list it; edgespec never "
                              "overwrites a file it did not write: move it away and run the export again")


def install_engines(bundle_dir: str, built: Mapping[str, Tuple[bytes, Mapping]], timing_cache: bytes) -> Tuple[str, ...]:
    """Write built engines ({model: (engine bytes, params)}) and the timing cache into the bundle, each
    atomically, register them as backend "tensorrt" of the target / drafters and rewrite bundle.yaml (which
    checksums them). A file at an engine's path that bundle.yaml does not list is refused, never overwritten."""
    writer = bundle_mod.BundleWriter.extend(bundle_dir)
    rels = [engine_path(n) for n in built] + [TIMING_CACHE]
    _refuse_unlisted(bundle_dir, rels, set(writer.manifest.get("files") or {}))
    os.makedirs(os.path.join(bundle_dir, ENGINE_DIR), exist_ok=True)
    for name, (engine, params) in built.items():
        rel = engine_path(name)
        if name != "target" and name not in writer.manifest.get("drafters", {}):
            raise BundleError(f"{bundle_dir}: no drafter {name!r} to attach {rel} to")
        write_bytes_atomically(os.path.join(bundle_dir, rel), engine)
        if name == "target":
            writer.add_target_backend("tensorrt", [rel], dict(params))
        else:
            writer.add_drafter_backend(name, "tensorrt", [rel], dict(params))
        print(f"wrote {bundle_dir}/{rel} ({len(engine) / 2**20:.1f} MiB, sha256 {sha256_bytes(engine)[:12]})")
    write_bytes_atomically(os.path.join(bundle_dir, TIMING_CACHE), timing_cache)
    writer.write()
    return tuple(rels)


def add_tensorrt_to_bundle(bundle_dir: str, max_context: Optional[int] = None, budget: Optional[int] = None,
                           verify_tokens: int = memory.DRAFT_SLACK, prefill_tokens: Optional[int] = None,
                           workspace_mb: int = 1024, lossy_weights: Optional[str] = None) -> Tuple[str, ...]:
    """Build an engine for every model of the bundle that has an ONNX graph (on this machine's GPU) and install
    them as backend "tensorrt". Nothing is written until every build succeeded. Returns the files written.
    lossy_weights "int8" / "int4": build from a weight-only quantized copy of each graph (export/tensorrt/quantize.py)."""
    b = bundle_mod.load(bundle_dir)
    models = _models(b)
    trt, cudart = import_tensorrt(), import_cudart()
    check_tensorrt_version(trt.__version__)
    facts = machine_facts(trt, cudart)
    rows = context_rows(b, max_context, budget, verify_tokens)
    prefill = min(prefill_tokens or PREFILL_TOKENS, rows)
    _refuse_unlisted(bundle_dir, [engine_path(m[0]) for m in models] + [TIMING_CACHE], set(b.files))
    cache_path = os.path.join(bundle_dir, TIMING_CACHE)
    previous = b.target.backends.get("tensorrt")
    same_trt = previous is not None and previous.params.get("tensorrt_version") == facts["tensorrt_version"]
    timing = open(cache_path, "rb").read() if same_trt and os.path.isfile(cache_path) else b""
    built: Dict[str, Tuple[bytes, Dict]] = {}
    for name, spec, onnx_rel, onnx_params in models:
        profiles = engine_profiles(spec.num_layers, spec.num_kv_heads, spec.head_dim, rows,
                                   min(verify_tokens, prefill), prefill)
        print(f"building {engine_path(name)} from {onnx_rel} ({rows} cache rows, verify <= {profiles[0].max_tokens}, "
              f"prefill <= {profiles[1].max_tokens} tokens); this takes minutes", flush=True)
        with tempfile.TemporaryDirectory(prefix=".quantize.", dir=bundle_dir) as scratch:
            source = b.path(onnx_rel)
            if lossy_weights is not None:
                from export.tensorrt.quantize import quantize_graph

                source = os.path.join(scratch, os.path.basename(onnx_rel))
                stats = quantize_graph(b.path(onnx_rel), source, lossy_weights)
                print(f"  {lossy_weights} weights (lossy): {stats['quantized']} projections, "
                      f"{stats['bytes_before'] / 2**20:.1f} -> {stats['bytes_after'] / 2**20:.1f} MiB")
            engine, timing, typed = build_engine(trt, source, profiles, timing, workspace_mb << 20)
        built[name] = (engine, engine_params(onnx_params, onnx_rel, b.files[onnx_rel].sha256, profiles, facts, typed,
                                             lossy_weights))
    return install_engines(bundle_dir, built, timing)
