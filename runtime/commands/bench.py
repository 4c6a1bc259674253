"""`edgespec bench`: plain decoding and each drafter measured side by side in one run, on the same
backend and prompts: speedup, tau, time per cycle split into draft / verify / other, memory, and
whether greedy output stayed token-identical to plain decoding.

Measurements are paired, because this kind of machine is shared and its speed drifts (sequential runs
of one drafter gave 1.27x, 0.76x and 2.24x): every round runs each prompt under every configuration
back to back (none, ngram, ..., none again; the order rotated from prompt to prompt, so that no
configuration always runs first, after another one's weights went through the caches), a configuration's speedup in a round is its tok/s over
plain decoding's in that round, and the table reports the median of those per-round ratios with their
min-max. The second plain-decoding configuration, the control, is measured exactly like a drafter: its
ratio to the first would be 1.00 on a quiet machine, so its spread is the noise floor of the run. The control
is opened first and plain decoding last (`open_order`): a session opened before many others can run a few
percent slower, which then shows in the control's ratio, never as a drafter's gain.

Example, 3 rounds: none 40, 38, 20 tok/s; draft_model 80, 84, 30 tok/s -> ratios 2.0, 2.2, 1.5 ->
speedup 2.0x [1.5-2.2] (the slow third round, a busy neighbour, hurt both and cancels in the ratio)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Dict, List, Tuple

import numpy as np

from runtime.backends.base import forward_in_chunks
from runtime.drafters import registry
from runtime.model import bundle as bundle_io
from runtime.memory import plan as memory
from runtime.commands.bench_backend import measure_bandwidth
from runtime.commands.bench_peers import open_peers, peer_request, peer_rows, run_peer
from runtime.commands.bench_plot import write_plots
from runtime.commands.bench_tally import Tally, paired_speedup  # noqa: F401 (paired_speedup: part of this command's API)
from runtime.commands.common import add_model_args, runtime_config, split_list
from runtime.errors import ConfigError, EdgespecError
from runtime.text.actions import has_action_tokens, no_action_tokens
from runtime.text.prompts import ACTION_TOKENS, format_observation
from runtime.serving.session import GenerationParams, Session, prompt_format
from runtime.text.templates import PromptFormat
from runtime.text.tokenizer import Tokenizer

HELP = """Benchmark plain decoding against speculative drafters on the same backend, in one run.

examples:
  edgespec bench --drafters none,ngram,draft_model --max-tokens 64
  edgespec bench --bundle build/bundles/zoo-standin --drafters none,ngram,draft_model,mtp --temperatures 0,1 --rounds 5
"""

# Requests in the zoo's own vocabulary (rooms, objects, people its generators use), but not from its training
# set; each bundle renders them with its own prompt format (domain -> (task, request values) list).
BENCH_REQUESTS = {
    "planner": [("planner", {"instruction": s, "context": ""}) for s in (
        "take the white hammer from the bathroom to Eve in the kitchen",
        "store the screwdriver from the living room in the cabinet, then put the apple from the laundry room on the bed",
        "give the red box from the workshop to Carol in the bedroom",
        "take the plastic toy out of the fridge in the office and put it on the sink",
    )],
    "action": [("action", {"instruction": s, "observation": format_observation(o)}) for s, o in (
        ("put down the white charger on the tray", [0.24, 0.23, 0.27, 0.39, 0.0, 0.38, 0.28, 0.02]),
        ("lift the metal apple", [0.30, -0.26, 0.11, -0.03, 0.0, 0.30, -0.26, 0.05]),
    )],
    "text": [("text", {"text": s}) for s in ("To be, or not to be", "Now is the winter of our discontent")],
}


def bench_prompts(fmt: PromptFormat, domains=tuple(BENCH_REQUESTS)) -> Dict[str, List[str]]:
    """The prompts of `domains` in the prompt format `fmt` (a bundle's `session.prompts`)."""
    return {d: [fmt.render(task, **values) for task, values in BENCH_REQUESTS[d]] for d in domains}


DEFAULT_DRAFTERS = ("none", "ngram", "draft_model")
CONTROL = "none (control)"  # plain decoding measured a second time, as if it were a drafter


def register(sub) -> None:
    p = sub.add_parser("bench", help="speedup of each drafter over plain decoding, measured side by side",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, drafter=False)  # bench compares drafters: --drafters names them all
    p.add_argument("--drafters",
                   help="comma-separated drafters to compare (default: those of none,ngram,draft_model the bundle "
                        "has); 'none' (plain decoding) is always run as the baseline, and again as the control row; "
                        "one this backend cannot run gets a row saying why")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt, >= 1 (default 64)")
    p.add_argument("--domains", help=f"comma-separated prompt sets to run, of {', '.join(BENCH_REQUESTS)} in the "
                                     "bundle's prompt format, and 'file' for --prompts (default: all those the bundle "
                                     "has templates for, or only 'file' when --prompts is given)")
    p.add_argument("--prompts", metavar="FILE",
                   help="your own prompts, one per line, used verbatim (already in the model's prompt format; a "
                        "literal \\n in a line is a newline): the prompt set 'file'")
    p.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3,
                   help="interleaved rounds, >= 1 (default 3): each round runs every prompt under every "
                        "configuration back to back; the speedup is the median of the per-round ratios")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated sampling temperatures, each >= 0 (default 0 = greedy); every "
                        "configuration runs at each")
    p.add_argument("--seed", type=int, help="RNG seed for sampling, >= 0 (default 0); round r, prompt i use seed + "
                                            "1000 r + i in every configuration")
    p.add_argument("--peers", default="",
                   help="comma-separated peers to run on the same weights and prompts, greedy only, interleaved "
                        "with edgespec: hf, hf_assisted, hf_lookup (transformers), ortgenai, ortgenai_draft, "
                        "ortgenai_ngram (onnxruntime-genai), llamacpp, llamacpp_draft, llamacpp_ngram (llama.cpp's "
                        "own tools on the bundle's GGUF files, built once into .cache/; llamacpp_eagle3/_mtp/_dflash "
                        "say why they cannot run), or 'all'; needs the workstation packages and the HF "
                        "folders below. A peer that cannot run gets a row saying why")
    p.add_argument("--peer-target", metavar="DIR",
                   help="HF folder of the target the peers load (default: zoo/target for the zoo bundle, "
                        "build/standin for the stand-in)")
    p.add_argument("--peer-draft", metavar="DIR", help="HF folder of the draft model for the draft-model peers "
                                                     "(default: zoo/draft for the zoo bundles)")
    p.add_argument("--plot", metavar="DIR", help="also write PNGs into DIR (needs matplotlib): speedup per drafter "
                                                 "and domain with its spread, tau vs draft length, time per cycle")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows instead of the table")
    p.set_defaults(func=run)


def parse_temperatures(text: str) -> List[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        temps = []
    if not temps or any(not (0.0 <= t <= 100.0) for t in temps):  # also refuses nan
        raise ConfigError(f"--temperatures: got {text!r}, expected a comma-separated list of numbers in [0, 100]")
    return temps


def unrunnable_domains(tokenizer) -> Dict[str, str]:
    """{domain: why this model cannot answer it}: the action domain needs the action-bin tokens (a model
    without them would be timed on free text that is no action at all)."""
    if has_action_tokens(tokenizer):
        return {}
    return {"action": no_action_tokens([t for t in ACTION_TOKENS if tokenizer.token_to_id(t) is None])}


def read_prompts(path: str) -> List[str]:
    """The prompts of a --prompts file: one per non-empty line, a literal \\n turned into a newline."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts: cannot read {path}: {exc}")
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts: {path} has no prompt (expected one per line)")
    return prompts


def weight_bytes_per_forward(session) -> int:
    """Target weight bytes one forward reads (its layers and LM head; the embedding is one row per token)."""
    body, head = memory.weight_bytes(session.plan_inputs.target, session.plan_inputs.precision,
                                     session.plan_inputs.head_precision)
    return body + head


# A greedy output may leave plain decoding's where two logits are this close, relative to their size: a batched
# and a one-token forward sum in other orders (fp32: ~1e-7 relative, the zoo's prompt 4 token 44 is 1 ulp of 8.19;
# f16 weights: up to ~1e-4, 2.5e-4 at logits ~10 seen on gguf). Wider, it is no rounding: a verification bug.
FLOAT_TIE_RELATIVE = 1e-4


def float_tie(gap: float, a: float, b: float) -> bool:
    """Whether two logits `gap` apart (a and b) are a float near-tie, not a wrong token.

    >>> float_tie(9.5e-7, 8.1935, 8.1935), float_tie(0.0, 8.1935, 8.1935), float_tie(0.07, 8.19, 8.12)
    (True, True, False)"""
    return abs(gap) <= FLOAT_TIE_RELATIVE * max(abs(a), abs(b), 1.0)


def near_tie(session, prompt_ids: List[int], plain: List[int], other: List[int]) -> Dict[str, object]:
    """Where a greedy output first differs from plain decoding's, the target's logit gap there between the two
    tokens (from a chunked forward of the context), and whether that gap is a float near-tie (`float_tie`)."""
    j = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    out: Dict[str, object] = {"position": j, "plain_token": plain[j] if j < len(plain) else None,
                              "other_token": other[j] if j < len(other) else None}
    if out["plain_token"] is None or out["other_token"] is None:
        return out  # one stopped (EOS) where the other went on: the EOS logit decided it
    ids = np.asarray(list(prompt_ids) + list(plain[:j]), np.int64)
    session.target.reset()
    logits = forward_in_chunks(session.target, ids, np.arange(len(ids)), (), session.engine.prefill_chunk,
                               all_logits=False).logits[-1]
    out["logit_gap"] = float(logits[plain[j]] - logits[other[j]])
    out["float_tie"] = float_tie(out["logit_gap"], float(logits[plain[j]]), float(logits[other[j]]))
    return out


def row(label: str, drafter: str, temp: float, t: Tally, base: Tally, session, bundle_name: str,
        by_domain: Dict[str, Tuple[Tally, Tally]], bytes_per_forward: int) -> Dict[str, object]:
    cyc = max(t.cycles, 1)
    decode_wall = sum(t.round_wall) - t.prefill
    greedy = temp == 0.0
    return {
        "drafter": drafter, "label": label, "control": label == CONTROL, "temperature": temp,
        "bundle": bundle_name, "standin": "standin" in bundle_name.lower(), "backend": session.backend_name,
        "shape": session.engine.shape,  # fixed, adaptive or adaptive (tuned): how the row drafted
        "draft_paths": t.draft_paths,  # proposals per drafting path (draft model: kstep / stepwise); {} for one
        "rounds": len(t.round_tps()), "tokens": sum(t.round_tokens),
        "tokens_per_s": statistics.median(t.round_tps()), **paired_speedup(t.round_tps(), base.round_tps()),
        "tau": t.tau_sum / cyc if t.cycles else 1.0,
        "ms_per_cycle": 1e3 * decode_wall / cyc, "draft_ms": 1e3 * t.draft / cyc,
        "verify_ms": 1e3 * t.verify / cyc, "other_ms": 1e3 * t.other / cyc,
        "ttft_ms": 1e3 * t.prefill / max(t.requests, 1),  # mean time to first token (= prefill) per request
        "prefix_reused": t.prefix_tokens / max(t.prompt_tokens, 1),  # share of prompt tokens the prefix cache kept
        "memory_mib": session.memory_in_use() / 2**20,
        "acceptance_by_depth": t.acceptance_by_depth(),
        "target_gb_per_s": bytes_per_forward * t.forwards / sum(t.round_wall) / 1e9,  # target weights read
        "by_domain": {d: {"tokens_per_s": statistics.median(dt.round_tps()), "tau": dt.tau_sum / dt.cycles if dt.cycles else 1.0,
                          **paired_speedup(dt.round_tps(), db.round_tps())} for d, (dt, db) in by_domain.items()},
        # sampled outputs legitimately differ between drafters (each consumes the RNG its own way)
        "identical_to_plain": t.outputs == base.outputs if greedy else None,
    }


def shape_suffixes(args) -> List[str]:
    """The draft shapes a --drafters name may ask for after '@': fixed, adaptive, or k1 .. k32 (a fixed chain of
    that depth), so one run compares a sweep of fixed shapes with the adaptive rule."""
    return ["fixed", "adaptive"] + [f"k{n}" for n in range(1, 33)]


def with_shape(cfg, label: str, kind: str):
    """The config of one bench row: `draft_model@k3` = the draft model drafting a fixed chain of 3."""
    drafter = replace(cfg.drafter, kind=kind)
    shape = label.split("@")[1] if "@" in label else None
    if shape in ("fixed", "adaptive"):
        drafter = replace(drafter, shape=shape)
    elif shape:
        drafter = replace(drafter, shape="fixed", num_tokens=int(shape[1:]))
    return replace(cfg, drafter=drafter)


def run(args) -> int:
    cfg = runtime_config(args)
    if args.rounds < 1:
        raise ConfigError(f"--rounds: got {args.rounds}, expected >= 1")
    temps = parse_temperatures(args.temperatures)
    bundle = bundle_io.load(cfg.bundle, verify_checksums=False)  # the names are checked before anything runs
    tokenizer = Tokenizer(bundle.path(bundle.tokenizer))
    fmt = prompt_format(bundle, tokenizer)
    own = {"file": read_prompts(args.prompts)} if args.prompts else {}
    cannot = unrunnable_domains(tokenizer)
    if args.domains is None:
        domains = list(own) or [d for d in BENCH_REQUESTS if fmt.has(d) and d not in cannot]
        for d in ([] if own else [d for d in cannot if fmt.has(d)]):
            print(f"bench: skipping the {d} domain: {cannot[d]}", file=sys.stderr, flush=True)
    else:
        domains = split_list("--domains", args.domains, [*BENCH_REQUESTS, *own])
        for d in domains:
            if d in cannot:
                raise ConfigError(f"--domains: {d}: {cannot[d]}")
            if d not in own:
                fmt.template(d)  # a BundleError saying what to add when the bundle has no template for it
    if args.drafters is None:  # the default: those of none, ngram, draft_model the bundle can run
        names = [n for n in DEFAULT_DRAFTERS if n in bundle.drafter_choices()]
    else:
        names = [n.strip() for n in args.drafters.split(",") if n.strip()]
        if not names:
            raise ConfigError(f"--drafters: got {args.drafters!r}, expected a comma-separated list of "
                              f"{bundle.drafter_choices()} (each may end in @fixed, @adaptive or @k1 .. @k32)")
        for n in names:
            base, _, shape = n.partition("@")
            if base not in bundle.drafter_choices():
                raise ConfigError(f"--drafters: got {args.drafters!r}; {registry.missing_drafter(bundle, base)}")
            if shape and shape not in shape_suffixes(args):
                raise ConfigError(f"--drafters: {n}: the shape after '@' must be fixed, adaptive or k1 .. k32")
    names = ["none"] + [n for n in dict.fromkeys(names) if n != "none"]
    configs = {n: n.split("@")[0] for n in names}
    configs[CONTROL] = "none"
    sets = {**bench_prompts(fmt, [d for d in domains if d not in own]), **own}
    prompts = [(d, p) for d in domains for p in sets[d]]  # (domain, text)
    wanted_peers = peer_request(args, bundle.name, bundle)
    bandwidth = measure_bandwidth(128 << 20, 3)  # the bound this run's tok/s is read against, measured in the run
    sessions, skipped = open_sessions(cfg, configs, prompts[0][1])
    configs = {label: kind for label, kind in configs.items() if label in sessions}
    peers: Dict[str, object] = {}
    try:
        peers, unavailable = open_peers(wanted_peers, sessions["none"].engine.eos, cfg.backend.threads)
        prompt_ids = [sessions["none"].tokenizer.encode(p) for _, p in prompts]
        max_tokens = cfg.generation.max_tokens
        for name in list(peers):  # a peer that fails here (its library refuses the model) becomes a row saying why
            try:
                run_peer(peers[name], prompt_ids[0], 4)
            except Exception as exc:  # noqa: BLE001 - any peer library error; edgespec's own rows go on
                unavailable[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                peers.pop(name).close()
        labels = list(configs) + list(peers)  # peers run at temperature 0 only (their output is checked)
        tallies = {(label, t, d): Tally() for label in labels for t in temps for d in ["all"] + domains}
        start = time.perf_counter()
        for r in range(args.rounds):
            for t in temps:
                for i, (domain, prompt) in enumerate(prompts):
                    params = GenerationParams(max_tokens=max_tokens, temperature=t,
                                              seed=cfg.generation.seed + 1000 * r + i)
                    k = (r * len(prompts) + i) % len(labels)  # rotated, so no configuration always runs first
                    for label in labels[k:] + labels[:k]:  # back to back: A B C, B C A, ...
                        if label not in sessions and (label not in peers or t != 0.0):
                            continue  # peers run greedy only; one that failed in an earlier round is gone
                        try:
                            res = (run_peer(peers[label], prompt_ids[i], max_tokens) if label in peers
                                   else sessions[label].generate(prompt, params))
                        except Exception as exc:  # noqa: BLE001 - a peer failing on one prompt becomes its row
                            if label not in peers:
                                raise
                            unavailable[label] = f"prompt {i}: {type(exc).__name__}: {str(exc).strip()[:300]}"
                            peers.pop(label).close()
                            continue
                        tallies[label, t, "all"].add(r, res)
                        tallies[label, t, domain].add(r, res)
            done = time.perf_counter() - start
            print(f"bench: round {r + 1}/{args.rounds} done, {done:.0f} s, ETA {done / (r + 1) * (args.rounds - r - 1):.0f} s",
                  file=sys.stderr, flush=True)
        per_forward = weight_bytes_per_forward(sessions["none"])
        table = []
        for t in temps:
            for label, kind in configs.items():
                tally, base = tallies[label, t, "all"], tallies["none", t, "all"]
                by_domain = {d: (tallies[label, t, d], tallies["none", t, d]) for d in domains}
                table.append(row(label, kind, t, tally, base, sessions[label], bundle.name, by_domain, per_forward))
                if cfg.decoding.lossy_typical_acceptance and kind != "none" and t > 0.0:
                    table[-1].update(label=label + "~lossy", lossy=True)  # typical acceptance: not the target's law
                if table[-1]["identical_to_plain"] is False:
                    n = next(n for n, (a, b) in enumerate(zip(base.outputs, tally.outputs)) if a != b)
                    table[-1]["near_tie"] = dict(near_tie(sessions["none"], prompt_ids[n % len(prompts)],
                                                          base.outputs[n], tally.outputs[n]), prompt=n % len(prompts))
        for r in table:
            r["bandwidth_bound_gb_per_s"] = bandwidth / 1e9
        if 0.0 in temps:
            table += peer_rows(peers, unavailable, {(k[0], k[1]): v for k, v in tallies.items() if k[2] == "all"},
                               table, bundle.name)
        table += [skipped_row(label, reason, bundle.name, sessions["none"].backend_name)
                  for label, reason in skipped.items()]
    finally:
        for s in sessions.values():
            s.close()
        for peer in peers.values():
            peer.close()
    if args.json:
        print(json.dumps(table))
    else:
        print_table(table, bundle.name, [p for _, p in prompts], domains, cfg, args.rounds)
    if args.plot:
        for path in write_plots(table, args.plot):
            print(f"bench: wrote {path}", file=sys.stderr)
    return exit_status(table)


def exit_status(table: List[Dict[str, object]]) -> int:
    """1 when a drafter's greedy output left plain decoding's by more than a float near-tie (a wrong token to
    report), else 0: a divergence at a float near-tie is named in its row (`near_tie`), not a failure.

    >>> exit_status([{"identical_to_plain": True}, {"identical_to_plain": False, "near_tie": {"float_tie": True}}])
    0
    >>> exit_status([{"identical_to_plain": False, "near_tie": {"float_tie": False}}])
    1"""
    return 0 if all(t.get("identical_to_plain") is not False or (t.get("near_tie") or {}).get("float_tie")
                    for t in table) else 1


def open_sessions(cfg, configs: Dict[str, str], warm_prompt: str) -> Tuple[Dict[str, Session], Dict[str, str]]:
    """({label: warmed-up Session}, {label: why it cannot run}) of `configs` ({label: drafter}): a drafter this
    bundle and backend cannot run (no graph for it, a tap the backend lacks) is skipped with its reason and the
    others run. Plain decoding must open: it is every row's baseline."""
    sessions: Dict[str, Session] = {}
    skipped: Dict[str, str] = {}
    for label in open_order(configs):
        kind = configs[label]
        session = None
        try:
            session = Session(with_shape(cfg, label, kind))
            # warm-up (caches, allocations) on the first prompt, and one cycle that surely drafts, as the ROS node
            # warms up: an adaptive shape may draft nothing on the warm prompt, and its first probe would pay the
            # drafter's first-run allocations (measured on the zoo: a draft model's first probe 14 ms, later ones
            # 2.5-3 ms; 6 ms after this warm-up). The adaptive rule learns from neither (their timings are first
            # runs': the warm prompt's once vetoed the n-gram drafter on the zoo's planner prompts)
            session.warm_up(warm_prompt)
        except EdgespecError as exc:
            if kind == "none":
                raise
            if session is not None:
                session.close()
            skipped[label] = str(exc)
            print(f"bench: skipping {label}: {exc}", file=sys.stderr, flush=True)
            continue
        sessions[label] = session
    return {label: sessions[label] for label in configs if label in sessions}, skipped


def open_order(labels) -> List[str]:
    """The order the bench opens its sessions in: the control first, plain decoding last, the drafters between.
    Where a session's memory lands can show in its speed (2 threads, zoo, 2026-12-07: on a slow afternoon VM a
    plain session opened after 16 others ran 4.6 % [4.2-6.7] faster than one opened before them, with the same
    weights and prompts; no difference at 1 thread, with none opened between, or once the VM calmed). Plain decoding opened last gets the placement of the
    latest session, so no drafter is favoured over its baseline by this; the control, opened first, shows the
    size of the effect (a ratio below 1.00) besides the run's noise. Since every configuration's target runs on one
    ORT session (runtime/backends/onnx_net.open_session), the order is left to the drafters' own graphs: the control
    read 0.99-1.01x in the first runs so (BENCHMARKS.md, Z23 and R15; 0.93-0.94x before, R14).

    >>> open_order(["none", "ngram", "draft_model", "none (control)"])
    ['none (control)', 'ngram', 'draft_model', 'none']"""
    labels = list(labels)
    return ([CONTROL] if CONTROL in labels else []) + [x for x in labels if x not in (CONTROL, "none")] + (
        ["none"] if "none" in labels else [])


def skipped_row(label: str, reason: str, bundle_name: str, backend: str) -> Dict[str, object]:
    """The row of a drafter that could not run here: its name and why, no measurements."""
    return {"drafter": label, "label": label, "skipped": reason, "control": False, "bundle": bundle_name,
            "backend": backend, "identical_to_plain": None}


def print_table(table: List[Dict[str, object]], bundle_name: str, prompts, domains, cfg, rounds: int) -> None:
    standin = table[0]["standin"]
    print(f"bench: bundle {bundle_name}{' (STAND-IN: zero-padded zoo target; predicts like it, costs like a wider model)' if standin else ''}, "
          f"{len(prompts)} prompts ({','.join(domains)}), max_tokens={cfg.generation.max_tokens}, "
          f"backend={table[0]['backend']}, {rounds} interleaved rounds; speedup = median of per-round tok/s ratios "
          "to 'none' [min-max]")
    print(f"{'drafter':17s} {'T':>4s} {'tok/s':>7s} {'speedup':>8s} {'[min-max]':>12s} {'tau':>5s} {'accept d1-4':>15s} "
          f"{'ms/cycle':>9s} {'draft':>7s} {'verify':>7s} {'other':>7s} {'TTFT ms':>8s} {'GB/s':>6s} {'MiB':>6s}  identical")
    for t in table:
        if t.get("peer"):
            continue
        if "skipped" in t:
            print(f"{t['label']:17s} skipped: {t['skipped']}")
            continue
        label = t["label"] + (" *" if standin else "")
        ident = {True: "yes", False: "NO", None: "n/a"}[t["identical_to_plain"]]
        acc = " ".join(f"{a:.2f}"[1:] if a < 1 else "1.0" for a in t["acceptance_by_depth"][:4]) or "-"
        print(f"{label:17s} {t['temperature']:4.1f} {t['tokens_per_s']:7.1f} {t['speedup']:7.2f}x "
              f"{'[' + format(t['speedup_min'], '.2f') + '-' + format(t['speedup_max'], '.2f') + ']':>12s} "
              f"{t['tau']:5.2f} {acc:>15s} {t['ms_per_cycle']:9.2f} {t['draft_ms']:7.2f} {t['verify_ms']:7.2f} "
              f"{t['other_ms']:7.2f} {t['ttft_ms']:8.2f} {t['target_gb_per_s']:6.1f} {t['memory_mib']:6.1f}  {ident}")
    for t in table:
        tie = t.get("near_tie")
        if tie:
            if "logit_gap" not in tie:
                why = "one output stopped (EOS) where the other went on"
            elif tie.get("float_tie"):
                why = (f"the target's logits for the two are {tie['logit_gap']:.2e} apart: a float near-tie (a "
                       "batched and a one-token forward round differently), not a wrong token")
            else:
                why = (f"the target's logits for the two are {tie['logit_gap']:.2e} apart: NOT a float near-tie; "
                       "greedy verification should never do this: please report it with this line")
            print(f"{t['label']} T={t['temperature']:g}: greedy output differs from plain decoding at prompt "
                  f"{tie['prompt']}, token {tie['position']} ({tie['plain_token']} vs {tie['other_token']}); {why}")
    if standin:
        print("* stand-in rows: the target is the zoo target widened with zero weights (edgespec zoo standin); tau is "
              "the zoo's, tok/s is a wider model's")
    print(f"GB/s: target weight bytes read per second (its layers and LM head per forward, prefills included); this "
          f"machine's streaming bound measured in this run: {table[0]['bandwidth_bound_gb_per_s']:.1f} GB/s (numpy copy)")
    print(f"'{CONTROL}' is plain decoding measured again like a drafter, its session opened first (plain's last): its "
          f"spread is this run's noise, a ratio below 1 the cost of an early session's placement; TTFT: mean "
          f"prefill per request, the prefix cache keeping {table[0]['prefix_reused']:.0%} of prompt tokens "
          f"(memory.prefix_cache: {cfg.memory.prefix_cache})")
    peers = [t for t in table if t.get("peer")]
    if peers:
        print("\npeers, same weights and prompts, greedy, interleaved with the rows above (speedup: over edgespec's "
              "plain decoding; edgespec/peer: edgespec's best greedy row over the peer, median of per-round ratios)")
        print(f"{'peer':24s} {'tok/s':>7s} {'speedup':>8s} {'tau':>5s} {'accept':>6s} {'edgespec/peer':>14s}  identical")
        for t in peers:
            if "unavailable" in t:
                print(f"{t['label']:24s} unavailable: {t['unavailable']}")
                continue
            tau = f"{t['tau']:5.2f}" if t["tau"] else "    -"
            ident = {True: "yes", False: "NO", None: "n/a"}[t["identical_to_plain"]]
            acc = f"{t['peer_accept']:6.2f}" if t.get("peer_accept") is not None else "     -"
            print(f"{t['label']:24s} {t['tokens_per_s']:7.1f} {t['speedup']:7.2f}x {tau} {acc} "
                  f"{t['edgespec_best_over_peer']:13.2f}x  {ident}   ({t['edgespec_best']})")
