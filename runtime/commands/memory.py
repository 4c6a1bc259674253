"""`edgespec memory plan` / `edgespec memory profile`: what fits on a device, and the plan checked against
the process's measured peak. The arithmetic is runtime/memory/plan.py; this only reads inputs and prints."""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from typing import Dict, Optional, Tuple

from runtime.memory import devices, plan as memory
from runtime.memory.bundle_sizes import backend_entry_key
from runtime.commands.common import edgespec_root, runtime_config
from runtime.commands.memory_plot import write_plan_plot
from runtime.config import override
from runtime.errors import BundleError, ConfigError
from runtime.serving.session import GenerationParams, Session

HELP = """Plan memory for a target + drafter on a device, or measure a bundle's peak against its plan.

examples:
  edgespec memory plan --config configs/models/qwen3-8b.json --drafter-config configs/models/qwen3-8b-eagle3.json \\
      --device orin_nx_16gb --precision int4
  edgespec memory plan --bundle build/bundles/zoo --device this_machine --budget 80% --json
  edgespec memory profile --bundle build/bundles/zoo --context 1024 --backend onnx
  edgespec memory profile --bundle build/bundles/zoo --context 128 --backend onnx --precision int8 --save
"""

PLAN_HELP = """Plan the memory of a target + drafter on a device, without loading any weights: one row per part of
the budget (weights, KV cache, drafter, forward scratch, runtime), the verdict (whether it fits, and the longest
context that does) and the biggest lever (the change that frees the most). Plans a bundle as the Session would
load it (--bundle), or any HF model from its config.json alone (--config), e.g. before downloading it.

examples:
  edgespec memory plan --bundle build/bundles/zoo --device this_machine
  edgespec memory plan --bundle build/bundles/zoo --backend onnx --drafter eagle3 --context 2048 --json
  edgespec memory plan --config configs/models/qwen3-8b.json --drafter-config configs/models/qwen3-8b-eagle3.json \\
      --device orin_nx_16gb --precision int4
"""

PROFILE_HELP = """Load a bundle, run one request whose prompt fills --context positions, and compare the process's
measured peak memory with the plan's rows for the same bundle, backend and context. --save stores the measured
runtime overhead in the bundle, so that later plans of that backend use it instead of a guess.

examples:
  edgespec memory profile --bundle build/bundles/zoo --context 1024 --backend onnx
  edgespec memory profile --bundle build/bundles/zoo --context 128 --backend onnx --precision int8 --save
"""


def register(sub) -> None:
    p = sub.add_parser("memory", help="memory plan for a device (what fits, max context) and measured peak vs plan",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="memory_command", metavar="<plan|profile>")
    cmds.required = True
    plan = cmds.add_parser("plan", help="rows of the budget, max context and verdict for a device",
                           description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = plan.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="a bundle directory (plans it as the Session loads it)")
    src.add_argument("--config", help="the target's HF config.json (e.g. configs/models/qwen3-1.7b.json)")
    plan.add_argument("--drafter-config", help="a drafter's HF config.json (a draft model or an EAGLE-3 head)")
    plan.add_argument("--drafter", help="with --bundle: the bundle drafter to plan (default: the bundle's)")
    plan.add_argument("--backend", choices=["numpy_ref", "onnx", "gguf", "tensorrt"], default="onnx",
                      help="with --bundle: the backend it runs on (default onnx)")
    add_device_args(plan)
    plan.add_argument("--precision", choices=memory.PRECISIONS,
                      help="with --config: decoder-layer weight precision (default fp16; q8_0 / q4_K_M: llama.cpp's "
                           "quants); with --bundle --backend onnx: the graph (fp32/fp16 = the float one, int8 / int4 = "
                           "entry onnx.int8 / onnx.int4); with --bundle --backend gguf: the quant (f16 / fp16, q8_0, q4_K_M; "
                           "default the most precise it holds), as backend.precision picks it")
    plan.add_argument("--head-precision", choices=[*memory.PRECISIONS, "q6_K"],
                      help="with --config: embedding and LM head precision (default fp16, as int4 runtimes keep it; "
                           "q6_K with --precision q4_K_M, as llama.cpp does)")
    plan.add_argument("--context", type=int, help="plan the rows at this context (default: the longest that fits, "
                                                   "at most the model's max_position_embeddings)")
    plan.add_argument("--exceed-max-position-embeddings", action="store_true",
                      help="plan contexts past the model's max_position_embeddings (memory.exceed_max_position_embeddings)")
    plan.add_argument("--num-draft", type=int, default=4, help="draft tokens per cycle (verify tree size), default 4")
    plan.add_argument("--prefill-chunk", type=int, default=memory.PREFILL_CHUNK,
                      help=f"tokens per prefill forward, as memory.prefill_chunk sets them (default "
                           f"{memory.PREFILL_CHUNK})")
    plan.add_argument("--plot", metavar="FILE.png", help="also write a PNG (needs matplotlib): the budget as a "
                                                          "stacked bar, and max context vs budget per drafter")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=run_plan)
    prof = cmds.add_parser("profile", help="load a bundle, run a request at a context, compare the peak to the plan",
                           description=PROFILE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    prof.add_argument("--bundle", help="bundle directory (default: the zoo)")
    prof.add_argument("--backend", choices=["auto", "numpy_ref", "onnx", "gguf", "tensorrt"],
                      help="backend (default auto)")
    prof.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8", "int4", "f16", "q8_0", "q4_K_M"],
                      help="onnx: the target graph (int8 / int4: entry onnx.int8 / onnx.int4); default auto")
    prof.add_argument("--drafter", help="drafter (default: the bundle's)")
    prof.add_argument("--context", type=int, default=1024, help="positions: the prompt fills them but --max-tokens")
    prof.add_argument("--max-tokens", type=int, default=32, help="tokens generated after the prompt (default 32)")
    prof.add_argument("--device", default="this_machine", help="device profile for the roofline (default this_machine)")
    prof.add_argument("--save", action="store_true",
                      help="store the measured runtime overhead (peak less every other planned row) in the bundle's "
                           "backend entry (params.memory_profile; bundle.yaml rewritten atomically, nothing else "
                           "changed); plans of this backend/precision then use it. Profile at a short --context "
                           "(e.g. 128) so that the fixed costs dominate")
    prof.add_argument("--json", action="store_true", help="print one JSON object")
    prof.set_defaults(func=run_profile, config=None)


def add_device_args(p) -> None:
    p.add_argument("--device", default="this_machine",
                   help="a profile in configs/devices (orin_nano_8gb, orin_nx_16gb, agx_orin_64gb, ...) or a YAML path")
    p.add_argument("--budget", help="bytes (5.5GB, 5GiB, 5632MiB) or a share of MemAvailable here (80%%); "
                                    "default: the device's memory less its reserved_mb")


def devices_dir() -> str:
    return os.path.join(edgespec_root(), "configs", "devices")


def _positive(flag: str, value) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{flag}: got {value}, expected an integer >= 1")


def plan_inputs(args) -> Tuple[memory.PlanInputs, Dict[str, memory.PlanInputs]]:
    """The inputs to plan, and those of each drafter choice (for --plot's curves)."""
    _positive("--num-draft", args.num_draft)
    _positive("--prefill-chunk", args.prefill_chunk)
    exceed = args.exceed_max_position_embeddings
    if args.bundle:
        from runtime.model import bundle as bundle_io
        if not os.path.isdir(args.bundle):
            raise BundleError(f"--bundle: {args.bundle}: no such directory; give a bundle directory (`make bundles` "
                              "builds build/bundles/zoo)")
        b = bundle_io.load(args.bundle, verify_checksums=False)
        drafter = args.drafter or b.default_drafter
        precision = args.precision or "auto"
        if args.backend == "onnx" and precision not in ("auto", "fp32", "fp16"):
            b.onnx_target(precision)  # a BundleError naming the export command when the graph is missing
        elif args.backend == "gguf":
            precision = b.gguf_quant(precision)  # a BundleError listing the quants it has, when it lacks this one
        elif args.backend != "onnx" and precision != "auto":
            raise ConfigError(f"--precision {precision}: with --bundle it picks an ONNX graph (--backend onnx) or "
                              f"a GGUF quant (--backend gguf); a {args.backend} entry has one precision, its own")
        from runtime.drafters import registry
        choices = {d: registry.plan_inputs(b, d, args.backend, args.num_draft + 1, precision, args.prefill_chunk,
                                           exceed) for d in ["none", *b.drafters]}
        return registry.plan_inputs(b, drafter, args.backend, args.num_draft + 1, precision, args.prefill_chunk,
                                    exceed), choices
    draft = memory.read_hf_config(args.drafter_config) if args.drafter_config else None
    precision = args.precision or "fp16"
    head = args.head_precision or memory.HEAD_OF_QUANT.get(precision, "fp16" if precision != "fp32" else "fp32")
    inp = memory.PlanInputs(target=memory.read_hf_config(args.config), drafter=draft, precision=precision,
                            head_precision=head, tree_tokens=args.num_draft + 1,
                            prefill_tokens=args.prefill_chunk, fused_attention=True, exceed_max_positions=exceed)
    choices = {"target alone": replace(inp, drafter=None, tree_tokens=1)}
    if draft is not None:
        choices[f"+ {os.path.basename(args.drafter_config)}"] = inp
    return inp, choices


def biggest_row(plan: memory.Plan) -> memory.Row:
    """The plan's largest row a setting can change (not the headroom, a share of the budget itself)."""
    return max((r for r in plan.rows if r.name != "headroom"), key=lambda r: r.bytes)


def run_plan(args) -> int:
    device = devices.load_device(args.device, devices_dir())
    budget = devices.parse_budget(args.budget) if args.budget else devices.device_budget(device)
    inp, choices = plan_inputs(args)
    _positive("--context", args.context)
    if args.context is not None:
        memory.check_context(inp, args.context, "--context")
    plan = memory.make_plan(inp, budget, args.context)
    if args.plot:
        src = args.bundle or os.path.basename(args.config)
        title = f"edgespec memory plan: {src} ({inp.precision} weights) on {device.name}"
        write_plan_plot(args.plot, plan, choices, title)
    levers = memory.levers(inp, budget, plan.context)
    roof_ctx = min(plan.context, 1024)
    roof = memory.projected_decode(inp, roof_ctx, device.bandwidth_gbs)
    capped = f" ({memory.limit_note(inp)})" if plan.capped_at else ""
    verdict = (f"fits: max context {plan.max_context}{capped}" if plan.fits and plan.max_context >= memory.MIN_CONTEXT
               else f"does NOT fit: needs {memory.budget_needed(inp, plan.context) / memory.GiB:.2f} GiB at "
                    f"{plan.context} positions")
    if args.json:
        print(json.dumps({"device": device.name, "verdict": verdict, **plan.to_dict(), "levers": levers,
                          "projection": {"context": roof_ctx, **roof}}))
        return 0 if plan.fits else 1
    src = args.bundle or args.config + (f" + {args.drafter_config}" if args.drafter_config else "")
    print(f"memory plan: {src} on {device.name}, budget {budget / memory.GiB:.2f} GiB, at {plan.context} positions")
    print(f"{'row':26s} {'MiB':>10s} {'share':>7s}  note")
    for r in plan.rows:
        print(f"{r.name:26s} {r.bytes / memory.MiB:10.1f} {r.bytes / budget:7.1%}  {r.note}")
    print(f"{'total':26s} {plan.total / memory.MiB:10.1f} {plan.total / budget:7.1%}")
    print(f"verdict: {verdict}")
    big = biggest_row(plan)
    hint = ""
    if not any(big.name in lever["rows"] for lever in levers):  # say so rather than let the lever below mislead
        hint = ("; it grows with the context: only a shorter one (memory.max_context, --context) shrinks it"
                if big.name.endswith("KV") else "; no lever below shrinks it")
    print(f"biggest row: {big.name} {big.bytes / memory.MiB:.1f} MiB ({big.bytes / budget:.0%} of the budget){hint}")
    if levers:
        top = levers[0]
        print(f"biggest lever: {top['lever']} frees {top['frees_bytes'] / memory.GiB:.2f} GiB "
              f"({', '.join(top['rows'])}; max context {top['max_context']})")
    print(f"projection (bandwidth bound, not measured): plain decode <= {roof['plain_tok_s_bound']:.1f} tok/s at "
          f"{device.bandwidth_gbs:g} GB/s at context {roof_ctx}, {roof['bytes_per_token'] / 1e9:.2f} GB read per token, LM head "
          f"{roof['lm_head_share']:.0%} of it")
    return 0 if plan.fits else 1


def process_memory() -> dict:
    """VmRSS and VmHWM (peak resident) of this process, bytes."""
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}


def device_memory_used(pid: int) -> Optional[int]:
    """Bytes of GPU memory process `pid` holds, from `nvidia-smi` (discrete GPUs); None where there is no
    nvidia-smi or it lists no such process (no GPU; Jetson, whose GPU memory is the process's own, is in VmHWM)."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines()]
    used = [int(r[1]) * memory.MiB for r in rows if len(r) == 2 and r[0].strip() == str(pid) and r[1].strip().isdigit()]
    return sum(used) if used else None


def save_overhead(bundle_dir: str, key: str, overhead: int, context: int, drafter: str, peak: int) -> str:
    """Store a measured runtime overhead in the bundle entry `key` (bundle_overhead reads it back)."""
    from runtime.model import bundle as bundle_io
    record = {"runtime_overhead_bytes": int(overhead), "context": context, "drafter": drafter, "peak_bytes": int(peak),
              "measured": time.strftime("%Y-%m-%d", time.gmtime())}
    return bundle_io.update_target_backend_params(bundle_dir, key, "memory_profile", record)


def run_profile(args) -> int:
    if args.context is None or args.context < memory.MIN_CONTEXT or args.max_tokens < 1 \
            or args.max_tokens >= args.context:
        raise ConfigError(f"--context/--max-tokens: got {args.context}/{args.max_tokens}; expected a context >= "
                          f"{memory.MIN_CONTEXT} and 1 <= max-tokens < context")
    device = devices.load_device(args.device, devices_dir())
    start = process_memory()
    cfg = runtime_config(args)
    cfg = override(cfg, "memory.max_context", args.context, "--context")
    session = Session(cfg)
    loaded = process_memory()
    text = "<|bos|><|text|>" + "the robot picks up the red cup and places it on the table. " * (args.context // 4)
    ids = session.tokenizer.encode(text)[:args.context - args.max_tokens]
    t0 = time.monotonic()
    _, tokens, _, stats = session.generate_ids(ids, GenerationParams(max_tokens=args.max_tokens))
    wall = time.monotonic() - t0
    end = process_memory()
    plan = memory.make_plan(session.plan_inputs, max(session.budget_bytes, 1), args.context)
    planned = plan.total - plan.row("headroom")
    kv_planned = plan.row("target KV") + plan.row("drafter KV")
    # what the other rows do not account for: the interpreter, libraries, the backend's own workspace
    overhead = end["VmHWM"] - (planned - plan.row("runtime overhead"))
    key = backend_entry_key(session.backend_name, cfg.backend.precision, session.bundle)
    roof = memory.projected_decode(session.plan_inputs, args.context, device.bandwidth_gbs, tau=stats.tau,
                                   num_draft=cfg.drafter.num_tokens)
    record = {"bundle": cfg.bundle, "backend": session.backend_name, "drafter": session.drafter_kind,
              "context": args.context, "prompt_tokens": len(ids), "generated": len(tokens), "wall_s": wall,
              "tau": stats.tau, "planned_peak_bytes": planned, "measured_peak_bytes": end["VmHWM"],
              "unaccounted_bytes": end["VmHWM"] - planned, "rss_after_load_bytes": loaded["VmRSS"],
              "kv_arena_bytes": session.arena.capacity_bytes, "kv_planned_bytes": kv_planned,
              "rows": plan.to_dict()["rows"], "projection": roof, "device": device.name,
              "entry": key, "measured_overhead_bytes": overhead, "device_memory_bytes": device_memory_used(os.getpid())}
    if args.save:
        record["saved_to"] = save_overhead(cfg.bundle, key, overhead, args.context, session.drafter_kind, end["VmHWM"])
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"memory profile: {cfg.bundle} backend={session.backend_name} drafter={session.drafter_kind} "
          f"context={args.context} (prompt {len(ids)} + {len(tokens)} generated, {wall:.1f} s, tau {stats.tau:.2f})")
    print(f"{'row':26s} {'planned MiB':>12s} {'measured MiB':>13s} {'unaccounted':>12s}")
    weights = plan.row("target weights") + plan.row("target embedding + head")
    compare = [("target weights", weights, getattr(session.target, "weight_bytes", None)),
               ("drafter weights", plan.row("drafter weights"), session.drafter.memory_bytes if session.drafter else 0),
               ("KV arena", kv_planned, session.arena.capacity_bytes),
               ("forward scratch", plan.row("forward scratch"), None),
               ("runtime overhead", plan.row("runtime overhead"), overhead),
               ("peak (VmHWM)", planned, end["VmHWM"])]
    for name, want, got in compare:
        m = f"{got / memory.MiB:13.1f} {(got - want) / memory.MiB:+12.1f}" if got is not None else ""
        print(f"{name:26s} {want / memory.MiB:12.1f} {m}")
    gap = end["VmHWM"] - planned
    print(f"peak: measured {gap / planned:+.1%} of the plan (weights as the backend reports them; runtime overhead "
          f"measured = the peak less every other planned row; planned: {plan.rows[-2].note})")
    if args.save:
        print(f"saved: runtime overhead {overhead / memory.MiB:.1f} MiB in {record['saved_to']} "
              f"(target.backends.{key}.params.memory_profile); plans of this backend/precision use it")
    print(f"resident after load {loaded['VmRSS'] / memory.MiB:.1f} MiB; at the start {start['VmRSS'] / memory.MiB:.1f} MiB")
    dev = record["device_memory_bytes"]
    print(f"device memory (nvidia-smi): {dev / memory.MiB:.1f} MiB" if dev is not None else
          "device memory: none measured (no nvidia-smi process entry: no discrete GPU in use; on Jetson it is in VmHWM)")
    spec = f", speculative <= {roof['speculative_tok_s_bound']:.1f} tok/s at the measured tau" \
        if "speculative_tok_s_bound" in roof else ""
    print(f"projection (bandwidth bound on {device.name}, {device.bandwidth_gbs:g} GB/s; not measured): "
          f"{roof['bytes_per_token'] / 1e6:.1f} MB read per token, LM head {roof['lm_head_share']:.0%}; plain decode <= "
          f"{roof['plain_tok_s_bound']:.1f} tok/s{spec}")
    return 0
