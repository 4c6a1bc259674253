"""The one drafter trainer: distillation on a frozen target, shared by every drafter kind.

    rows of token ids  ->  frozen target (no grad): logits + the hidden taps the drafter reads  ->  TargetBatch
                       ->  task(batch) -> loss  ->  AdamW step  ->  progress line / atomic checkpoint

A drafter kind plugs in as a `DrafterTask`: an `nn.Module` whose `forward(batch)` returns the loss (and a
few numbers to print), whose `taps` name the target hidden states it reads (runtime tap names:
"final_norm", "layer_out.i", "layer_in.i"), and whose `export(out_dir)` writes its weights in the kind's
OFFICIAL file layout. The trainer owns everything else: data, the target forward, the optimiser and LR
schedule, progress, checkpoints and resume, and data parallelism: under `torchrun --nproc-per-node N`
(gloo on CPU) the task is wrapped in DistributedDataParallel and each process takes its share of every
batch's rows, so a task never sees whether it runs alone or on N processes.

Labels are the target's own predictions (its soft distribution), never the data's tokens: a drafter is
judged by how often the target accepts it, so it learns the target, mistakes included.

Batch i is a pure function of (seed, i), and a checkpoint holds the task, the optimiser, the step and the held-out
curve: `--resume` continues exactly where a run stopped. Checkpoints are written to a temporary file and renamed.

Where batches come from: computed by the target at each step (`OnTheFly`), or read from the feature cache
(export/drafters/features.py: the target's taps and top-k logits over a fixed set of rows, computed once). Every
`eval_every` steps the task is evaluated on held-out batches (export/drafters/heldout.py: per-depth acceptance,
expected tau, the curve in work/curve.json), and `until_plateau` stops when that tau stops rising. On a GPU
(`device` cuda) the task runs under autocast (bf16, or fp16 with loss scaling) and torchrun uses NCCL.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from export.drafters.data import DOMAINS
from export.drafters.heldout import evaluate, plateaued, write_curve
from export.drafters.parallel import Dist
from runtime.errors import ConfigError
from export.training import lr_at, save_checkpoint  # noqa: F401 (the schedule and checkpoints every loop shares)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600  # stop at this many optimiser steps ...
    budget_s: float = 600.0  # ... or after this much training time, whichever comes first
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    batch: int = 8  # rows per step (all processes together)
    seq_len: int = 256
    seed: int = 7
    token_mix: Tuple[float, ...] = (0.65, 0.25, 0.10)  # planner, action, text share of trained tokens
    n_planner: int = 20000
    n_action: int = 8000
    n_text: int = 3000
    checkpoint_every_s: float = 60.0
    log_every: int = 10
    threads: int = 2
    top_k: int = 0  # > 0: the target's distribution truncated to its top-k logits (what the feature cache keeps)
    eval_every: int = 0  # held-out evaluation every this many steps (0: only at the end, when held-out rows exist)
    until_plateau: bool = False  # stop when held-out expected tau stops rising (see `plateaued`); constant LR
    patience: int = 3  # ... for this many evaluations in a row
    min_gain: float = 0.005  # ... by more than this fraction of the best tau so far
    device: str = "cpu"  # "cpu" | "cuda" (resolved; see resolve_device)

@dataclass
class TargetBatch:
    """What a drafter task trains on: one packed batch seen by the frozen target."""
    ids: torch.Tensor  # (B, T) int64 input tokens
    positions: torch.Tensor  # (B, T) rotary positions (restart at 0 at each document)
    attn_mask: torch.Tensor  # (B, 1, T, T) bool "may attend" (block-diagonal causal)
    doc: torch.Tensor  # (B, T) document index per position; positions i, j share a document iff equal (pad: -1)
    # (B, T, V) float32: the target's next-token logits at each position; or, cut to its top k (the feature cache,
    # --top-k), (B, T, V + 1): the k logits in place, -inf elsewhere, and in column V the rest's log-sum-exp, so
    # the loss still sees how much mass the target puts outside its top k (`keep_top_k`, `soft_cross_entropy`)
    logits: torch.Tensor
    taps: Dict[str, torch.Tensor]  # name -> (B, T, H) float32 target hidden states
    embed: torch.Tensor  # (V, H) the target's input embedding (frozen)
    head: torch.Tensor  # (V, H) the target's LM head (frozen; the embedding when tied)

    def same_doc(self, shift: int) -> torch.Tensor:
        """(B, T) bool: position t and position t + shift exist and lie in one document (False past the end)."""
        B, T = self.doc.shape
        ok = torch.zeros(B, T, dtype=torch.bool, device=self.doc.device)
        if shift < T:
            a, b = self.doc[:, :T - shift], self.doc[:, shift:]
            ok[:, :T - shift] = (a == b) & (a >= 0)
        return ok


class DrafterTask(nn.Module):
    """The interface a drafter kind implements (see the module docstring)."""
    kind: str = "base"
    taps: Tuple[str, ...] = ()

    def forward(self, batch: TargetBatch) -> Tuple[torch.Tensor, Dict[str, float]]:
        """-> (scalar loss, {name: number} to print). For data parallelism to average exactly, normalise the
        loss by the batch's number of positions (B*T), not by a count that differs between processes.
        It also sets `self.tally` = [(hits, count)] per draft depth (1, 2, ...): how often the drafter's top
        token at that depth is the target's own (teacher-forced: the path above it right), for evaluation."""
        raise NotImplementedError

    def export(self, out_dir: str) -> List[str]:
        """Write the trained weights in the kind's official layout; returns the files written."""
        raise NotImplementedError


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """(n, V), (n, V) or (n, V + 1) -> (n,) KL(p_target || q) per row: what a drafter minimises to match the target.
    A target cut to its top k (`keep_top_k`: column V the rest's log-sum-exp) is matched on its k tokens and on
    the mass of the rest as ONE outcome: q must leave the rest what p leaves it, however q spreads it there. Cut
    without that column, p renormalised over its top 64 left the zoo's heads no mass for the rest: at T = 1 the
    target puts 6 % of its mass outside its top 64 on action prompts and 26 % on text (BENCHMARKS.md, run T1),
    mass a sampled draft can then never match.

    >>> q = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    >>> full = torch.tensor([[2.0, 1.0, 0.5, -1.0]])  # p over all four tokens
    >>> cut = keep_top_k(full, 2)  # the top 2 and the rest (tokens 2, 3) as one outcome
    >>> float(soft_cross_entropy(q, cut)) <= float(soft_cross_entropy(q, full))  # the lumped KL is a lower bound
    True
    >>> float(soft_cross_entropy(full, cut)) < 1e-6  # and zero at q = p
    True"""
    logq = F.log_softmax(logits.float(), -1)
    target_logits = target_logits.float()
    if target_logits.shape[-1] == logq.shape[-1] + 1:
        p_all = F.softmax(target_logits, -1)  # the k named tokens and the rest, normalised together
        p, p_rest = p_all[..., :-1], p_all[..., -1]
        logq_rest = logq.masked_fill(torch.isfinite(target_logits[..., :-1]), float("-inf")).logsumexp(-1)
        rest = torch.where(p_rest > 0, torch.xlogy(p_rest, p_rest) - p_rest * logq_rest, torch.zeros_like(p_rest))
        return (torch.xlogy(p, p) - p * logq).sum(-1) + rest
    p = F.softmax(target_logits, -1)
    # xlogy: 0 * log 0 = 0 where a top-k target leaves tokens out (their logits are -inf)
    return (torch.xlogy(p, p) - p * logq).sum(-1)


def target_argmax(target_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The target's own greedy token per row, of (..., V) or top-k cut (..., V + 1) logits (the rest is no token)."""
    return target_logits[..., :vocab].argmax(-1)


def depth_tally(logits: torch.Tensor, target_logits: torch.Tensor, sampled: bool = True) -> Tuple[float, ...]:
    """One draft depth's held-out numbers over its n rows, (n, V) drafter logits against the target's (n, V) or
    cut (n, V + 1): (greedy hits, n, sampled acceptance summed, its upper bound summed).

    Greedy: the drafter's top token is the target's. Sampled (T = 1): a token drawn from q is accepted with
    probability sum_x min(p(x), q(x)) (the accept-or-resample rule). Against a cut target only the top k of p are
    known: summing over them gives a lower bound, and adding min(p_rest, q_rest) an upper one (the rest as one
    outcome can only overlap more than its tokens do); without a cut the two are equal. `sampled` False (a
    training step) leaves the sampled sums at 0.

    >>> p = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> h, n, lo, hi = depth_tally(p, keep_top_k(p, 2))  # q = p: greedy hit; sampled 1 - the rest's mass .. 1
    >>> h, n, round(lo, 3), round(hi, 3)
    (1.0, 1, 0.881, 1.0)
    >>> [round(x, 6) for x in depth_tally(p, p)[2:]]  # against the whole target: one number
    [1.0, 1.0]"""
    vocab = logits.shape[-1]
    hits = float((logits.argmax(-1) == target_argmax(target_logits, vocab)).float().sum())
    n = int(logits.shape[0])
    if not sampled or n == 0:
        return hits, n, 0.0, 0.0
    q = F.softmax(logits.float(), -1)
    p_all = F.softmax(target_logits.float(), -1)
    p = p_all[..., :vocab]
    lo = torch.minimum(p, q).sum(-1)
    hi = lo
    if target_logits.shape[-1] == vocab + 1:
        q_rest = q.masked_fill(torch.isfinite(target_logits[..., :vocab]), 0.0).sum(-1)
        hi = lo + torch.minimum(p_all[..., vocab], q_rest)
    return hits, n, float(lo.sum()), float(hi.sum())


# ---- data ---------------------------------------------------------------------------------------------------------

class RowSampler:
    """Packs examples into full rows of seq_len tokens (the last example cut at the row's end); batch i is a
    pure function of (seed, i), so every process and every resumed run sees the same batch i."""

    def __init__(self, data: Dict[str, list], cfg: TrainConfig, split: str = "train"):
        names = [k[:-len(split) - 1] for k in sorted(data) if k.endswith("_" + split) and len(data[k])]
        if not names:
            raise ValueError(f"no {split} examples in the data ({sorted(data)})")
        self.pools = [data[f"{d}_{split}"] for d in names]
        # the zoo's domains in their token mix; any other pool (a --data file) by its size
        mix = np.array([cfg.token_mix[DOMAINS.index(d)] if d in DOMAINS else 1.0 for d in names])
        w = mix / np.array([np.mean([len(x) for x in p]) for p in self.pools])  # example odds giving the token mix
        self.p = w / w.sum()
        self.cfg = cfg

    def batch(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """-> ids (B, T), doc (B, T) (document index within the row)."""
        rng = np.random.default_rng([self.cfg.seed, i])
        B, T = self.cfg.batch, self.cfg.seq_len
        ids = np.zeros((B, T), np.int64)
        doc = np.full((B, T), -1, np.int64)
        for b in range(B):
            pos, n = 0, 0
            while pos < T:
                d = rng.choice(len(self.pools), p=self.p)
                x = self.pools[d][rng.integers(len(self.pools[d]))][:T - pos]
                ids[b, pos:pos + len(x)] = x
                doc[b, pos:pos + len(x)] = n
                pos += len(x)
                n += 1
        return torch.from_numpy(ids), torch.from_numpy(doc)


def packed_layout(doc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """doc (B, T) -> positions (B, T) restarting at each document, mask (B, 1, T, T) block-diagonal causal."""
    B, T = doc.shape
    d = doc.clone()
    d[d < 0] = 10_000
    mask = ((d[:, :, None] == d[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=d.device).tril())[:, None]
    start = torch.ones_like(d, dtype=torch.bool)
    start[:, 1:] = d[:, 1:] != d[:, :-1]
    idx = torch.arange(T, device=d.device).expand(B, T)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first, mask


@torch.no_grad()
def target_batch(target, ids: torch.Tensor, doc: torch.Tensor, taps: Sequence[str], top_k: int = 0) -> TargetBatch:
    """Run the frozen target (export.drafters.target.TargetLM, or the zoo's LlamaLM) on packed rows on its
    device, keeping the requested taps (float32). top_k > 0: cut to each position's top k (`keep_top_k`)."""
    device = target.embed_tokens.weight.device
    ids, doc = ids.to(device), doc.to(device)
    positions, mask = packed_layout(doc)
    if hasattr(target, "rope"):
        cos, sin = target.rope(positions)
    else:
        from export.zoo.model import rope_cos_sin

        cos, sin = rope_cos_sin(target.cfg, positions)
    dtype = target.embed_tokens.weight.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    got: Dict[str, torch.Tensor] = {}
    # float32 on CPU: on CPUs without native bf16 an autocast forward measured 5x slower (14.6 s vs 2.3 s a batch)
    x = target.embed_tokens(ids)
    for i, layer in enumerate(target.layers):
        if f"layer_in.{i}" in taps:
            got[f"layer_in.{i}"] = x.float()
        x = layer(x, cos, sin, mask)
        if f"layer_out.{i}" in taps:
            got[f"layer_out.{i}"] = x.float()
    h = target.norm(x)
    logits = target.head(h).float()
    if top_k:
        logits = keep_top_k(logits, top_k)
    if "final_norm" in taps:
        got["final_norm"] = h.float()
    return TargetBatch(ids, positions, mask, doc, logits, got, *frozen_embed_head(target))


def frozen_embed_head(target) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head (the embedding when tied) in float32, converted once per target (a bf16
    GPU target's 150k x 4096 matrices are not copied at every step)."""
    if getattr(target, "_f32_embed_head", None) is None:
        embed = target.embed_tokens.weight
        head = embed if target.lm_head is None else target.lm_head.weight
        target._f32_embed_head = (embed.detach().float(), head.detach().float())
    return target._f32_embed_head


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(..., V) -> (..., V + 1): the logits where they are among the row's k largest, -inf elsewhere, and in
    column V the log-sum-exp of the others (the rest's mass on the logits' scale; -inf when k >= V).

    >>> keep_top_k(torch.tensor([[3.0, 0.0, 1.0, 0.0]]), 2)
    tensor([[3.0000,   -inf, 1.0000,   -inf, 0.6931]])"""
    vals, idx, rest = top_k_and_rest(logits, k)
    return torch.cat([torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals), rest[..., None]], -1)


def top_k_and_rest(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., V) -> the k largest logits (..., k), their token ids (..., k) and the log-sum-exp of the others (...):
    what `keep_top_k` lays out and the feature cache stores."""
    vals, idx = logits.topk(min(k, logits.shape[-1]), -1)
    return vals, idx, logits.scatter(-1, idx, float("-inf")).logsumexp(-1)


class LazyBatches:
    """n batches made one at a time when iterated (batch i = make(i)): a held-out set of big-vocabulary (B, T, V)
    logits is never all in memory at once."""

    def __init__(self, make: Callable[[int], TargetBatch], n: int):
        self.make, self.n = make, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return (self.make(i) for i in range(self.n))


class OnTheFly:
    """Training batches computed by the target at each step: batch i = the target on RowSampler batch i."""

    def __init__(self, data: Dict[str, list], cfg: TrainConfig, target, taps: Sequence[str], split: str = "train",
                 first: int = 0):
        self.rows, self.target, self.taps, self.top_k, self.first = RowSampler(data, cfg, split), target, taps, \
            cfg.top_k, first

    def batch(self, i: int, mine: slice = slice(None)) -> TargetBatch:
        ids, doc = self.rows.batch(self.first + i)
        return target_batch(self.target, ids[mine], doc[mine], self.taps, self.top_k)


# ---- the loop -----------------------------------------------------------------------------------------------------

def write_checkpoint(out_dir: str, weights: Dict[str, np.ndarray], config: Dict) -> List[str]:
    """A trained drafter in the official HF layout: out_dir/model.safetensors + out_dir/config.json, each written
    to a temporary name and renamed (atomic). Returns [model, config] paths."""
    from runtime.model.tensors import write_safetensors

    model = os.path.join(out_dir, "model.safetensors")
    write_safetensors(model + ".tmp", weights)
    os.replace(model + ".tmp", model)
    path = os.path.join(out_dir, "config.json")
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(path + ".tmp", path)
    return [model, path]


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: List[float] = field(default_factory=list)  # loss of every step run by this call (all processes' mean)
    last: Dict[str, float] = field(default_factory=dict)  # the last progress numbers
    curve: List[Dict[str, object]] = field(default_factory=list)  # held-out evaluations of the whole run
    stopped: str = ""  # why it stopped: "steps", "budget", "plateau" or "paused"


def train(task: DrafterTask, target, data: Optional[Dict[str, list]], cfg: TrainConfig, work: str,
          resume: bool = False, log: Callable[[str], None] = print, pause_at: Optional[int] = None,
          source=None, heldout: Sequence[TargetBatch] = (), snapshot: bool = False) -> TrainResult:
    """Distil `task` from the frozen `target` until cfg.steps, cfg.budget_s or (cfg.until_plateau) a plateau of
    held-out tau; checkpoints in work/ckpt.pt, the held-out curve in work/curve.json. `source`: where batch i
    comes from (`batch(i, rows)`; default: computed on the fly from `data`; see export/drafters/features.py for
    the cache); `heldout`: the batches evaluated every cfg.eval_every steps and at the end.
    `pause_at`: stop after that step as an interrupted run would (checkpoint written, schedule unchanged).
    `snapshot`: load the checkpoint and stop before any step (the drafter as it stands, for a look while the run
    goes on; the checkpoint is not written)."""
    dist = Dist.from_env(cfg.device)
    if cfg.batch % dist.world:
        raise ValueError(f"batch {cfg.batch} rows cannot be split evenly over {dist.world} processes")
    if cfg.until_plateau and not heldout:
        raise ValueError("until_plateau needs held-out batches to judge the plateau by")
    torch.set_num_threads(max(1, cfg.threads // dist.world))
    say = log if dist.rank == 0 else (lambda _msg: None)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    task.to(dist.device)
    model = task
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(task)
    params = [p for p in task.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gpu = dist.device.startswith("cuda")
    amp = (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16) if gpu else None
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)  # fp16 needs loss scaling; bf16 not
    ckpt = os.path.join(work, "ckpt.pt")
    os.makedirs(work, exist_ok=True)
    start, elapsed, curve = 0, 0.0, []
    if resume and os.path.exists(ckpt):
        st = torch.load(ckpt, weights_only=True, map_location=dist.device)  # our own file; plain tensors and numbers
        if st.get("kind") != task.kind or _same_run(st.get("config")) != _same_run(_plain(cfg)):
            was, now = _same_run(st.get("config")) or {}, _same_run(_plain(cfg))
            differ = [f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
            what = f"kind {st.get('kind')} -> {task.kind}" if st.get("kind") != task.kind else ", ".join(differ)
            raise ConfigError(f"{ckpt}: a checkpoint of another run ({what}); resume (or --snapshot) with the run's "
                              "own settings, or start afresh without --resume")
        task.load_state_dict(st["task"])
        opt.load_state_dict(st["opt"])
        start, elapsed = int(st["step"]), float(st["elapsed"])
        curve = json.loads(st.get("curve", "[]"))
        say(f"{task.kind}: resumed at step {start} ({elapsed / 60:.1f} min already trained)")
    source = source or OnTheFly(data, cfg, target, task.taps)
    mine = slice(dist.rank, cfg.batch, dist.world)
    result = TrainResult(start, elapsed, curve=curve)
    task.train()
    t0, t_ckpt, tokens = time.time(), time.time(), 0
    step = start
    stop = "steps" if step >= cfg.steps else "budget" if elapsed >= cfg.budget_s else ""
    if snapshot:
        if not (resume and os.path.exists(ckpt)):
            raise FileNotFoundError(f"{ckpt}: no checkpoint to take a snapshot of; train with --work {work} first")
        stop = "snapshot"
    if not stop and cfg.until_plateau and plateaued([c["tau"] for c in curve], cfg.patience, cfg.min_gain):
        stop = "plateau"
    while not stop:
        progress = 0.0 if cfg.until_plateau else max(step / cfg.steps, (elapsed + time.time() - t0) / cfg.budget_s)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, cfg.lr, cfg.warmup)
        batch = source.batch(step, mine)
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            loss, numbers = model(batch)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        tokens += int((batch.doc >= 0).sum()) * dist.world
        step += 1
        now = time.time()
        spent = elapsed + now - t0
        mean_loss = dist.mean(float(loss.item()))
        result.losses.append(mean_loss)
        final = step >= cfg.steps or spent >= cfg.budget_s
        if heldout and ((cfg.eval_every and step % cfg.eval_every == 0) or final):
            with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
                point = {"step": step, "seconds": round(spent, 1), "train_loss": round(mean_loss, 5),
                         **evaluate(task, heldout)}
            curve.append(point)
            say(f"{task.kind} held-out at step {step}: loss {point['loss']:.4f} acceptance per depth "
                + " ".join(f"{a:.3f}" for a in point["per_depth"]) + f" -> expected tau {point['tau']:.3f}"
                + f" (T = 1: {point['tau_t1']:.3f}, at most {point['tau_t1_hi']:.3f})")
            if dist.rank == 0:
                write_curve(os.path.join(work, "curve.json"), task.kind, cfg, curve)
        # the stop decision must be the same in every process: rank 0's clock and curve decide
        stop = "steps" if step >= cfg.steps else ""
        if not stop and dist.agree(spent >= cfg.budget_s):
            stop = "budget"
        if not stop and cfg.until_plateau and dist.agree(plateaued([c["tau"] for c in curve], cfg.patience,
                                                                    cfg.min_gain)):
            stop = "plateau"
        paused = pause_at is not None and step >= pause_at
        if step % cfg.log_every == 0 or stop or step == start + 1:
            numbers = {k: dist.mean(v) for k, v in numbers.items()}
            result.last = {"loss": mean_loss, **numbers}
            eta = min((now - t0) / (step - start) * (cfg.steps - step), cfg.budget_s - spent)
            say(f"{task.kind} step {step}/{cfg.steps} loss {mean_loss:.4f} "
                + " ".join(f"{k} {v:.3f}" for k, v in numbers.items())
                + f" lr {opt.param_groups[0]['lr']:.2e} {tokens / (now - t0):.0f} tok/s "
                  f"elapsed {spent / 60:.1f} min" + ("" if cfg.until_plateau else f" ETA {max(eta, 0) / 60:.1f} min"))
        if hasattr(source, "epoch_done"):
            source.epoch_done(step, now - t0, say)
        if dist.rank == 0 and (now - t_ckpt > cfg.checkpoint_every_s or stop or paused):
            save_checkpoint(ckpt, kind=task.kind, config=_plain(cfg), task=task.state_dict(), opt=opt.state_dict(),
                            step=step, elapsed=spent, curve=json.dumps(curve))
            t_ckpt = now
        if paused:
            stop = "paused"
    if stop == "plateau":
        say(f"{task.kind}: held-out tau stopped rising (no gain over {cfg.min_gain:.1%} of the best in "
            f"{cfg.patience} evaluations): stopping at step {step}")
    result.steps, result.seconds, result.stopped = step, elapsed + time.time() - t0, stop
    task.eval()
    return result


def _same_run(config) -> Dict[str, object]:
    """What must match to resume: everything but the stopping point and the bookkeeping."""
    skip = ("steps", "budget_s", "checkpoint_every_s", "log_every", "threads", "device", "eval_every", "patience",
            "min_gain")
    return {k: v for k, v in (config or {}).items() if k not in skip}


def _plain(cfg: TrainConfig) -> Dict[str, object]:
    """The config as plain data (stored in checkpoints; lists, not tuples, so that weights_only loads it)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
