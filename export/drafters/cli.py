"""`edgespec train-drafter <kind>`: distil a drafter from a target with the shared trainer (export side)."""
from __future__ import annotations

import argparse
import os
import sys
import time

HELP = """Train a drafter by distillation on a frozen target, with the shared trainer (export/drafters/trainer.py).

The target runs teacher-forced over generated robot-planner / action-token data and Shakespeare (the zoo's
domains, tokenized with the target's tokenizer); the drafter learns the target's own next-token
distributions. Progress lines show step, loss, per-head top-1 agreement, tokens/s and ETA; a checkpoint is
written to --work every minute (atomically) and --resume continues from it.

What a real run needs: the target as an HF directory the zoo model class reads (zoo/target: Llama config +
model.safetensors + tokenizer.json), torch (pip install 'edgespec[export]'), network once for the Shakespeare
texts (else the text domain is left out, with a message), and a few minutes of CPU: the shipped zoo heads
took 10 min on 2 shared cores. For data parallelism run it under torchrun (gloo on CPU); each process takes
its share of every batch's rows:
  torchrun --nproc-per-node 2 -m runtime.cli train-drafter medusa --target zoo/target --out /tmp/heads

A robot-sized target (0.6-8 B) is a GPU job: the EAGLE papers train on about 68K ShareGPT dialogues (EAGLE-1;
EAGLE-3 adds UltraChat-200K) and report 1-2 days on 4 A100s for 7-70 B targets, i.e. on the order of 100
GPU-hours; a 1-2 B target takes a fraction of that. This command does not do that run yet: its data are
the zoo's domains (no chat-corpus option) and its processes run on CPU over gloo (no CUDA placement/NCCL).

examples:
  edgespec train-drafter medusa --target zoo/target --out zoo/medusa --heads 4 --minutes 10
  edgespec train-drafter medusa --target zoo/target --out /tmp/heads --steps 20 --batch 2 --seq-len 64
  edgespec train-drafter eagle3 --target zoo/target --out zoo/eagle3 --minutes 5 --unroll 4

EAGLE (eagle1, eagle3): one decoder layer trained with the training-time test (unrolled --unroll steps on its
own outputs, loss weights 0.8^j), written as config.json + model.safetensors (fp16) in the official layout
(export/drafters/eagle.py). A real target needs the same data pipeline and, published heads report, on the
order of a few GPU-days on ShareGPT/UltraChat-scale data for an 8B target.

DFlash (dflash, dflash2): --layers Qwen3-style draft layers reading the target's layer outputs, trained on
--anchors blocks per row (each of a length drawn from --block-sizes: the bundle gets one drafter per size),
slot weights exp(-(t-1)/7); dflash2 adds local mixing and the candidate selector (--selector-rank, top-16).
Written as config.json + model.safetensors (fp16) in the z-lab layout (export/drafters/dflash.py):
  edgespec train-drafter dflash2 --target zoo/target --out zoo/dflash2 --layers 2 --minutes 12
"""

KINDS = ("medusa", "eagle1", "eagle3", "dflash", "dflash2")


def register(sub) -> None:
    p = sub.add_parser("train-drafter", help=f"distil a drafter ({', '.join(KINDS)}) from a target with the shared "
                                             "trainer",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=KINDS, help="the drafter kind to train")
    p.add_argument("--target", required=True, metavar="DIR", help="the target's HF directory (e.g. zoo/target)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the drafter is written in its official layout (medusa: medusa_lm_head.safetensors "
                        "+ config.json); existing files there are replaced only with --force")
    p.add_argument("--work", metavar="DIR", help="checkpoints and cached data (default: build/train-drafter/<kind>)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--force", action="store_true", help="replace the drafter files already in --out")
    p.add_argument("--heads", type=int, default=4, help="medusa: number of heads, 1..16 (default 4)")
    p.add_argument("--layers", type=int, default=1,
                   help="medusa: ResBlocks per head, 0..8; dflash: draft layers, 1..8 (default 1)")
    p.add_argument("--steps", type=int, default=600, help="optimiser steps at most (default 600)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time at most, in minutes (default 10)")
    p.add_argument("--batch", type=int, default=8, help="rows per step over all processes (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=7, help="data and batch-order seed (default 7)")
    p.add_argument("--tree-nodes", type=int, default=32,
                   help="medusa: nodes at most of the tree tuned on the trained heads (default 32; 0 = no tree)")
    p.add_argument("--threads", type=int, default=2, help="torch threads over all processes (default 2)")
    p.add_argument("--unroll", type=int, default=4, help="eagle: training-time-test steps (default 4; official 7)")
    p.add_argument("--block-sizes", default="8,16",
                   help="dflash: block lengths trained, the largest is the config's block_size (default 8,16)")
    p.add_argument("--anchors", type=int, default=32, help="dflash: blocks trained per row (default 32)")
    p.add_argument("--selector-rank", type=int, default=64, help="dflash2: candidate selector rank (default 64)")
    p.set_defaults(func=run)


def _check(args) -> None:
    from runtime.errors import ConfigError

    for flag, value, lo, hi in (("--heads", args.heads, 1, 16), ("--layers", args.layers, 0, 8),
                                ("--steps", args.steps, 1, 10**7), ("--batch", args.batch, 1, 4096),
                                ("--seq-len", args.seq_len, 8, 1 << 16), ("--tree-nodes", args.tree_nodes, 0, 256),
                                ("--threads", args.threads, 1, 256)):
        if not lo <= value <= hi:
            raise ConfigError(f"{flag}: got {value}, expected {lo}..{hi}")
    if args.kind.startswith("dflash"):
        try:
            sizes = sorted({int(x) for x in args.block_sizes.split(",") if x.strip()})
        except ValueError:
            sizes = []
        if not sizes or not all(2 <= b <= 64 for b in sizes):
            raise ConfigError(f"--block-sizes: got {args.block_sizes!r}, expected comma-separated block lengths 2..64")
        args.block_sizes = sizes
        for flag, value, lo, hi in (("--layers", args.layers, 1, 8), ("--anchors", args.anchors, 1, 4096),
                                    ("--selector-rank", args.selector_rank, 1, 4096)):
            if not lo <= value <= hi:
                raise ConfigError(f"{flag}: got {value}, expected {lo}..{hi}")
    if not args.minutes > 0 or not args.lr > 0:
        raise ConfigError(f"--minutes and --lr must be > 0, got {args.minutes} and {args.lr}")
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        raise ConfigError(f"--target {args.target}: no config.json there; give the target's HF directory")
    if not os.path.isfile(os.path.join(args.target, "tokenizer.json")):
        raise ConfigError(f"--target {args.target}: no tokenizer.json there; the data is tokenized with it")
    from export.drafters.medusa import HEAD_FILE

    files = (HEAD_FILE, "config.json") if args.kind == "medusa" else ("model.safetensors", "config.json")
    taken = [n for n in files if os.path.exists(os.path.join(args.out, n))]
    if taken and not args.force:
        raise ConfigError(f"--out {args.out} already holds {', '.join(taken)}; pass --force to replace them")


def run(args) -> int:
    _check(args)
    import torch

    from export.drafters.data import build_token_data
    from export.drafters.medusa import accuracy_report, measure_accuracy, medusa_task, top_k_accuracy, tune_tree
    from export.drafters.trainer import Dist, TrainConfig, train
    from export.zoo.model import load_hf

    def log(msg: str) -> None:
        print(f"[train-drafter {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    cfg = TrainConfig(steps=args.steps, budget_s=60 * args.minutes, lr=args.lr, batch=args.batch,
                      seq_len=args.seq_len, seed=args.seed, threads=args.threads)
    work = args.work or os.path.join("build", "train-drafter", args.kind)
    torch.manual_seed(args.seed)
    target = load_hf(args.target)
    rank = Dist.from_env().rank
    data = build_token_data(os.path.join(args.target, "tokenizer.json"), work, cfg.seed, cfg.n_planner,
                            cfg.n_action, cfg.n_text, log if rank == 0 else (lambda _m: None))
    if args.kind.startswith("dflash"):
        return _train_dflash(args, cfg, work, target, data, rank, log)
    if args.kind != "medusa":
        return _train_eagle(args, cfg, work, target, data, rank, log)
    task = medusa_task(target, args.heads, args.layers)
    (log if rank == 0 else (lambda _m: None))(f"medusa: {args.heads} heads x {args.layers} ResBlocks "
        f"({sum(p.numel() for p in task.parameters()) / 1e6:.2f} M params) on {args.target}; "
        f"up to {cfg.steps} steps of {cfg.batch}x{cfg.seq_len} tokens or {args.minutes:g} min")
    result = train(task, target, data, cfg, work, resume=args.resume, log=log)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    config = {"medusa_num_heads": args.heads, "medusa_num_layers": args.layers,
              "base_model_name_or_path": os.path.abspath(args.target) if not os.path.isabs(args.target) else args.target,
              "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size,
              "training": {"command": "edgespec " + " ".join(sys.argv[1:]), "steps": result.steps,
                           "seconds": round(result.seconds, 1), "final": {k: round(v, 4) for k, v in result.last.items()}}}
    if args.target.rstrip("/").endswith("zoo/target"):
        config["base_model_name_or_path"] = "zoo/target"
    if args.tree_nodes:
        acc = measure_accuracy(task, target, data, cfg)
        choices, tau = tune_tree(acc, args.tree_nodes)
        log("accuracy per head on held-out batches (top-k: the target's token among the head's k best; "
            "rank-i: it is the head's i-th candidate, what the tree search weighs): "
            + "; ".join(accuracy_report(acc)))
        log(f"tuned tree: {len(choices)} nodes, expected tau {tau:.2f} (greedy, independence assumed)")
        config["medusa_choices"] = choices
        config["tree_tuning"] = {"accuracy_by_rank": [[round(float(a), 4) for a in row[:5]] for row in acc],
                                 "top_k_accuracy": [[round(float(a), 4) for a in row[:5]] for row in top_k_accuracy(acc)],
                                 "expected_tau": round(tau, 3), "max_nodes": args.tree_nodes}
    files = task.export(args.out, config)
    log(f"wrote {', '.join(files)} ({os.path.getsize(files[0]) / 2**20:.1f} MiB)")
    return 0


def _train_eagle(args, cfg, work, target, data, rank, log) -> int:
    from export.drafters.eagle_train import EagleTask
    from export.drafters.trainer import train

    if not 1 <= args.unroll <= 16:
        from runtime.errors import ConfigError
        raise ConfigError(f"--unroll: got {args.unroll}, expected 1..16")
    task = EagleTask("eagle" if args.kind == "eagle1" else "eagle3", target, unroll=args.unroll)
    log(f"{args.kind}: one layer ({sum(p.numel() for p in task.parameters() if p.requires_grad) / 1e6:.2f} M params), "
        f"training-time test over {args.unroll} steps, on {args.target}; up to {cfg.steps} steps of "
        f"{cfg.batch}x{cfg.seq_len} tokens or {args.minutes:g} min")
    result = train(task, target, data, cfg, work, resume=args.resume, log=log)
    if rank != 0:
        return 0
    return _export_trained(args, task, result, log)


def _train_dflash(args, cfg, work, target, data, rank, log) -> int:
    from export.drafters.dflash_train import DFlashTask
    from export.drafters.trainer import train
    from runtime.text.prompts import PAD

    from tokenizers import Tokenizer

    mask = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json")).token_to_id(PAD)
    task = DFlashTask(args.kind, target, layers=args.layers, block_size=max(args.block_sizes),
                      block_sizes=args.block_sizes, anchors=args.anchors, mask_token_id=0 if mask is None else mask,
                      selector_rank=args.selector_rank)
    say = log if rank == 0 else (lambda _m: None)
    say(f"{args.kind}: {args.layers} layers ({sum(p.numel() for p in task.parameters()) / 1e6:.2f} M params) reading "
        f"{', '.join(task.taps)}, blocks of {'/'.join(map(str, task.block_sizes))}, {args.anchors} per row, on "
        f"{args.target}; up to {cfg.steps} steps of {cfg.batch}x{cfg.seq_len} tokens or {args.minutes:g} min")
    result = train(task, target, data, cfg, work, resume=args.resume, log=log)
    if torch_dist_initialized():
        import torch.distributed

        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    return _export_trained(args, task, result, log)


def _export_trained(args, task, result, log) -> int:
    """Write the trained drafter in its official layout, its config naming the target and how it was trained."""
    base = "zoo/target" if args.target.rstrip("/").endswith("zoo/target") else os.path.abspath(args.target)
    files = task.export(args.out, {"base_model_name_or_path": base,
                                   "training": {"command": "edgespec " + " ".join(sys.argv[1:]), "steps": result.steps,
                                                "seconds": round(result.seconds, 1),
                                                "final": {k: round(v, 4) for k, v in result.last.items()}}})
    log(f"wrote {', '.join(files)} ({os.path.getsize(files[0]) / 2**20:.1f} MiB)")
    return 0


def torch_dist_initialized() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()
