"""The peers of `edgespec bench --peers`: other runtimes' speculative decoding on the same weights and prompts,
run inside the bench's interleaved rounds (greedy only; each peer's output is checked against edgespec's plain
decoding). The peers themselves live in the workstation package (export/peers/registry.py, which may import torch);
this module only opens them by name, times them, and turns their tallies into rows."""
from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from runtime.commands.bench_tally import paired_speedup
from runtime.commands.common import edgespec_root, split_list
from runtime.decode.engine import DecodeStats
from runtime.errors import ConfigError
from runtime.model.bundle import gguf_entries

PEER_MODULE = "export.peers.registry"  # workstation package, imported by name as runtime.cli does: never a robot dependency


@dataclass
class PeerRun:
    """A peer's generation in the shape Tally.add reads from an edgespec result."""
    token_ids: List[int]
    stats: DecodeStats


def default_peer_dirs(bundle_name: str):
    """(target, draft) HF folders the zoo bundles were made from, under the source tree; (None, None) else."""
    root = edgespec_root()
    target = {"zoo": "zoo/target", "zoo-standin": "build/standin"}.get(bundle_name)
    if target is None:
        return None, None
    return os.path.join(root, target), os.path.join(root, "zoo/draft")


@dataclass
class PeerRequest:
    """What --peers asked for, checked before any model is loaded."""
    module: object  # export.peers.registry
    names: List[str]
    target: str
    draft: Optional[str]
    gguf_target: Optional[str] = None  # the bundle's GGUF files, which the llama.cpp peers run on
    gguf_draft: Optional[str] = None


def bundle_ggufs(bundle) -> Tuple[Optional[str], Optional[str]]:
    """(target GGUF, draft model GGUF) the bundle's manifest lists for backend gguf, or None each: its most
    precise quant, and the draft model's GGUF of that quant (else its most precise)."""
    def first(entry):
        files = [f for f in (entry.files if entry else ()) if f.endswith(".gguf")]
        return bundle.path(files[0]) if files else None
    quants = gguf_entries(bundle.target.backends)
    target = bundle.target.backends[next(iter(quants.values()))] if quants else None
    draft = next((d for d in bundle.drafters.values() if d.kind == "draft_model" and gguf_entries(d.backends)), None)
    if draft is None:
        return first(target), None
    have = gguf_entries(draft.backends)
    quant = target.params.get("quant", "f16") if target is not None else None
    return first(target), first(draft.backends[have.get(quant, next(iter(have.values())))])


def peer_request(args, bundle_name: str, bundle=None) -> Optional[PeerRequest]:
    """The checked --peers request (None when no peers are asked for); ConfigError for a bad list or folder.
    The llama.cpp peers read the bundle's own GGUF files and need no HF folder."""
    text = (args.peers or "").strip()
    if not text:
        return None
    try:
        peers = importlib.import_module(PEER_MODULE)
    except ImportError as exc:
        raise ConfigError(f"--peers: the peers live in the workstation package ({exc}); install it with "
                          "pip install -e '.[export]' and run from the source tree")
    names = list(peers.PEER_NAMES) if text == "all" else split_list("--peers", text, peers.PEER_NAMES)
    target, draft = default_peer_dirs(bundle_name)
    target, draft = args.peer_target or target, args.peer_draft or draft
    gguf_only = all(n in getattr(peers, "GGUF_PEERS", ()) for n in names)
    if target is None and not gguf_only:
        raise ConfigError(f"--peer-target: bundle {bundle_name!r} is not a zoo bundle; give the HF folder of its "
                          "target (--peer-target DIR, and --peer-draft DIR for the draft-model peers)")
    gguf_target, gguf_draft = bundle_ggufs(bundle) if bundle is not None else (None, None)
    return PeerRequest(peers, names, target or "", draft, gguf_target, gguf_draft)


def open_peers(req: Optional[PeerRequest], eos_ids, threads: int = 0) -> Tuple[Dict[str, object], Dict[str, str]]:
    """({name: ready peer}, {name: why it cannot run}); `threads`: edgespec's backend.threads, for the peers that
    take a thread count (llama.cpp's tools)."""
    if req is None:
        return {}, {}
    models = req.module.PeerModels(target=req.target, draft=req.draft, eos_ids=tuple(sorted(eos_ids)),
                                   gguf_target=req.gguf_target, gguf_draft=req.gguf_draft, threads=threads)
    cache = os.path.join(edgespec_root(), ".cache", "peers")
    ready, unavailable = {}, {}
    for name in req.names:
        print(f"bench: preparing peer {name}", file=sys.stderr, flush=True)
        try:
            ready[name] = req.module.open_peer(name, models, cache)
        except req.module.PeerUnavailable as exc:
            unavailable[name] = str(exc)
    return ready, unavailable


# After a peer's generation its library's idle threads may still spin (onnxruntime-genai's intra-op pools, which
# spin by default): the configuration run next paid for them, 37 % slower (zoo, 2 threads, plain decoding always
# ran right after the draft peer in the rotation: 608 tok/s against 967 in the control row). An untimed pause.
PEER_SETTLE_S = 0.05


def run_peer(peer, prompt_ids: List[int], max_tokens: int, settle_s: float = PEER_SETTLE_S) -> PeerRun:
    """One greedy generation by a peer, timed like edgespec's wall_s (prefill included), then `settle_s` untimed
    so that its threads are idle before the next configuration runs."""
    t0 = time.perf_counter()
    ids, extra = peer.generate(prompt_ids, max_tokens)
    wall = time.perf_counter() - t0
    time.sleep(settle_s)
    wall = float(extra.get("wall_s", wall))  # a subprocess peer's own prompt + generation time (load excluded)
    stats = DecodeStats(tokens=len(ids), wall_s=wall, other_s=wall, drafter=peer.name)
    forwards = int(extra.get("target_forwards", 0))
    if extra.get("cycles"):  # target forwards after the prompt, as the peer counted them
        stats.cycles, stats.tau = int(extra["cycles"]), float(extra.get("tokens", len(ids))) / int(extra["cycles"])
    elif forwards > 1 and ids:  # the prefill gives the first token; each later forward, the rest
        stats.cycles, stats.tau = forwards - 1, (len(ids) - 1) / (forwards - 1)
    return PeerRun(list(ids), stats)


def peer_rows(peers, unavailable, tallies, table, bundle_name: str) -> List[Dict[str, object]]:
    """One row per peer at temperature 0: its tok/s, its ratio to edgespec's plain decoding, and edgespec's
    best greedy configuration over it (median of per-round ratios), or why it could not run."""
    greedy = [t for t in table if t["temperature"] == 0.0 and not t["control"]]
    best = max(greedy, key=lambda t: t["speedup"])
    best_tps = tallies[best["label"], 0.0].round_tps()
    plain = tallies["none", 0.0]
    rows = []
    for name, peer in peers.items():
        t = tallies[name, 0.0]
        cyc = t.cycles
        rows.append({
            "drafter": f"peer:{name}", "label": peer.label, "control": False, "temperature": 0.0, "peer": True,
            "bundle": bundle_name, "standin": "standin" in bundle_name.lower(), "backend": "peer",
            "rounds": len(t.round_tps()), "tokens": sum(t.round_tokens),
            "tokens_per_s": statistics.median(t.round_tps()), **paired_speedup(t.round_tps(), plain.round_tps()),
            "tau": t.tau_sum / cyc if cyc else None,
            "edgespec_best": best["label"],
            "edgespec_best_over_peer": statistics.median(a / b for a, b in zip(best_tps, t.round_tps())),
            "identical_to_plain": t.outputs == plain.outputs,
            "peer_accept": peer.accept_rate() if hasattr(peer, "accept_rate") else None,
        })
    for name, why in unavailable.items():
        rows.append({"drafter": f"peer:{name}", "label": name, "control": False, "temperature": 0.0, "peer": True,
                     "bundle": bundle_name, "unavailable": why, "identical_to_plain": None})
    return rows
