"""`edgespec train-drafter <kind>`: distil a drafter from a target with the shared trainer (export side)."""
from __future__ import annotations

import argparse
import os
import sys
import time

HELP = """Train a drafter by distillation on a frozen target, with the shared trainer (export/drafters/trainer.py).

The target is any HF directory `edgespec bundle` accepts (Llama, Qwen2, Qwen3: config.json + safetensors +
tokenizer.json), read with the bundle's reader. It runs teacher-forced over the training rows and the drafter
learns the target's own next-token distributions: its top --top-k logits and the mass of all the others as one
more outcome (KL over both, so a drafter learns to leave the rest what the target does: what sampling at T > 0
draws from; export/drafters/trainer.py soft_cross_entropy). The rows are, by default, the zoo's
domains (robot planner, action tokens, Shakespeare; tokenized with the target's tokenizer: the generators'
example texts, or with --zoo-data answers their prompts in the target's prompt format answered by the target
itself, the text a drafter is asked to guess when it serves), or with --data FILE
the user's prompts or chats (JSONL, one {"prompt": ...} or {"messages": [{"role", "content"}, ...]} a line),
rendered with the target's own chat template as the bundle renders requests and answered by the target itself
(--samples continuations each: the first greedy, the rest sampled at T = 1).

The target's taps and top-k logits over --cache-rows rows are computed once into a feature cache (sharded,
memory-mapped .npy under --cache-dir, keyed on a hash of target + rows + top-k, one file per tap) and every
drafter kind and epoch reads them back; the log says what a cached epoch costs against the target's forward.
Every --eval-every steps the drafter is evaluated on held-out rows (every 20th example): per-depth acceptance
and the expected tokens per cycle tau of its chain, printed and written to <work>/curve.json.
--until-plateau trains until held-out tau stops rising (no gain above 0.5 % of the best for --patience
evaluations in a row; constant learning rate after warm-up), not for a fixed time. A checkpoint is written to
--work every minute (atomically) and --resume continues the same run and loss curve; --snapshot writes the
drafter as the checkpoint holds it, training no step (a look at a long run while it goes on).

Devices: --device auto (CUDA when torch sees a GPU) | cpu | cuda. On a GPU the target is held in bf16 (fp16
where bf16 is missing) and the drafter runs under autocast; for data parallelism run it under torchrun (NCCL on
GPUs, one per process by LOCAL_RANK; gloo on CPU); each process takes its share of every batch's rows:
  torchrun --nproc-per-node 2 -m runtime.cli train-drafter medusa --target zoo/target --out /tmp/heads
  torchrun --nproc-per-node 8 -m runtime.cli train-drafter eagle3 --target Qwen3-8B --data chats.jsonl \\
      --keep-answers --out /data/eagle3 --device cuda --batch 16 --seq-len 2048 --cache-rows 100000 --until-plateau

What a real run needs: the zoo's heads train in minutes on 2 CPU cores. A robot-sized target (0.6-8 B) is a
GPU job: the EAGLE papers train on about 68K ShareGPT dialogues (EAGLE-1; EAGLE-3 adds UltraChat-200K, i.e.
~100-500 M tokens) and report 1-2 days on 4 A100s for 7-70 B targets, i.e. on the order of 100 GPU-hours; a
1-2 B target takes a fraction of that (~10-20 GPU-hours). Here that means:
  data    a --data file of 50-250K prompts or chats. The target answers the prompts here in batches of 32
          (KV cache, eager torch): fine for tens of thousands; for more, have a serving engine run the SAME target
          over the prompts and pass its chats with --keep-answers (the rows are then its answers as given);
  cache   rows x seq-len x (2 x taps x hidden + 6 x top-k) bytes in fp16 (EAGLE-3 on an 8 B target: ~33 KB a
          token, ~3.3 TB per 100 M tokens): cache a subset with --cache-rows, or pass --no-cache;
  memory  the target's weights (8 B in bf16: 16 GB) plus, per row of a batch on a GPU, the target's full
          (seq-len x vocabulary) float32 distribution (2K x 152K: 1.2 GB): 1-2 rows per GPU at 2K tokens.

examples:
  edgespec train-drafter medusa --target zoo/target --out zoo/medusa --heads 4 --minutes 10
  edgespec train-drafter medusa --target zoo/target --out /tmp/heads --steps 20 --batch 2 --seq-len 64
  edgespec train-drafter eagle3 --target zoo/target --out zoo/eagle3 --until-plateau --unroll 4
  edgespec train-drafter eagle3 --target ~/models/Qwen3-0.6B --data prompts.jsonl --out /tmp/eagle3 --device auto

EAGLE (eagle1, eagle3): one decoder layer trained with the training-time test (unrolled --unroll steps on its
own outputs, loss weights 0.8^j), written as config.json + model.safetensors (fp16) in the official layout
(export/drafters/eagle.py).

DFlash (dflash, dflash2): --layers Qwen3-style draft layers reading the target's layer outputs, trained on
--anchors blocks per row (each of a length drawn from --block-sizes: the bundle gets one drafter per size),
slot weights exp(-(t-1)/7); dflash2 adds local mixing and the candidate selector (--selector-rank, top-16).
Written as config.json + model.safetensors (fp16) in the z-lab layout (export/drafters/dflash.py):
  edgespec train-drafter dflash2 --target zoo/target --out zoo/dflash2 --layers 2 --minutes 12

MTP (mtp): a DeepSeek-V3-style multi-token-prediction module for a target that ships none (one decoder layer of
the target's family on [emb(x_t+1), h_t], the target's head), written with the keys model.layers.N.*; add it
to the target's bundle with `edgespec bundle --target DIR --mtp OUT --out BUNDLE`.
"""

from export.drafters import registry

KINDS = tuple(registry.trainers())  # every kind's trainer (export/drafters/kinds/<name>.py)


def register(sub) -> None:
    kinds = tuple(registry.trainers())  # read here, so that a kind's module is all it takes
    p = sub.add_parser("train-drafter", help=f"distil a drafter ({', '.join(kinds)}) from a target with the shared "
                                             "trainer",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=kinds, help="the drafter kind to train")
    p.add_argument("--target", required=True, metavar="DIR", help="the target's HF directory (e.g. zoo/target)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the drafter is written in its official layout (medusa: medusa_lm_head.safetensors "
                        "+ config.json); existing files there are replaced only with --force")
    p.add_argument("--work", metavar="DIR", help="checkpoints and cached data (default: build/train-drafter/<kind>)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    p.add_argument("--snapshot", action="store_true",
                   help="write the drafter from the checkpoint in --work as it stands, train no step (with the "
                        "run's own settings; the run may go on meanwhile and later with --resume)")
    p.add_argument("--force", action="store_true", help="replace the drafter files already in --out")
    p.add_argument("--layers", type=int, default=1,
                   help="medusa: ResBlocks per head, 0..8; dflash: draft layers, 1..8 (default 1)")
    p.add_argument("--steps", type=int, help="optimiser steps at most (default 600; with --until-plateau: no cap)")
    p.add_argument("--minutes", type=float,
                   help="training time at most, in minutes (default 10; with --until-plateau: no cap)")
    p.add_argument("--until-plateau", action="store_true",
                   help="train until held-out tau stops rising (see --patience) instead of for --steps/--minutes")
    p.add_argument("--patience", type=int, default=3,
                   help="--until-plateau: evaluations in a row without a gain above 0.5%% of the best (default 3)")
    p.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every N steps (default 50)")
    p.add_argument("--eval-rows", type=int, default=32, help="held-out rows evaluated (default 32)")
    p.add_argument("--data", metavar="FILE",
                   help="JSONL prompts or chats to distil on ({\"prompt\": ...} or {\"messages\": [...]} a line), "
                        "answered by the target; default: the zoo's domains")
    p.add_argument("--keep-answers", action="store_true",
                   help="--data: train on the chats' own assistant turns (answers the target wrote elsewhere, e.g. "
                        "with a serving engine) instead of having the target answer here")
    p.add_argument("--samples", type=int, default=2,
                   help="--data, --zoo-data answers: the target's continuations per prompt, the first greedy, the rest sampled at T=1 "
                        "(default 2)")
    p.add_argument("--gen-tokens", type=int, help="--data, --zoo-data answers: tokens the target writes per continuation at most "
                                                  "(default --seq-len)")
    p.add_argument("--zoo-examples", type=int,
                   help="zoo domains: planner examples (action: 2/5 of it, text: 3/20; default 20000)")
    p.add_argument("--zoo-domains", default="planner,action,text",
                   help="zoo domains used without --data, comma-separated (default planner,action,text)")
    p.add_argument("--zoo-data", default="examples", choices=("examples", "answers"),
                   help="zoo domains without --data: 'examples' trains on the generators' example texts (default), "
                        "'answers' on their prompts answered by the target itself (--samples, --gen-tokens), the "
                        "text the drafter will be asked to guess")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto: cuda when there is a GPU)")
    p.add_argument("--top-k", type=int, default=64,
                   help="the target's distribution kept as its top-k logits and the rest's total mass (default 64; "
                        "0 = all, --no-cache only)")
    p.add_argument("--no-cache", action="store_true", help="compute the target's features at every step")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="feature and data cache, shared by every kind (default build/train-drafter/cache)")
    p.add_argument("--cache-rows", type=int, default=512,
                   help="training rows in the feature cache: one epoch (default 512)")
    p.add_argument("--cache-dtype", default="float16", choices=("float16", "float32"),
                   help="how cached taps and logits are stored (default float16)")
    p.add_argument("--batch", type=int, default=8, help="rows per step over all processes (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=7, help="data and batch-order seed (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads over all processes (default 2)")
    for ex in registry.EXPORTS:  # each kind's own training flags
        if ex.train_arguments is not None:
            ex.train_arguments(p)
    p.set_defaults(func=run)


def _check(args) -> None:
    from runtime.errors import ConfigError

    if args.steps is None:
        args.steps = 10**7 if args.until_plateau else 600
    if args.minutes is None:
        args.minutes = 1e9 if args.until_plateau else 10.0
    args.gen_tokens = args.gen_tokens or args.seq_len
    registry.check_ranges((("--layers", args.layers, 0, 8), ("--steps", args.steps, 1, 10**7),
                           ("--batch", args.batch, 1, 4096), ("--seq-len", args.seq_len, 8, 1 << 16),
                           ("--threads", args.threads, 1, 256), ("--patience", args.patience, 1, 1000),
                           ("--eval-every", args.eval_every, 1, 10**7), ("--eval-rows", args.eval_rows, 1, 10**6),
                           ("--samples", args.samples, 1, 64), ("--gen-tokens", args.gen_tokens, 1, 1 << 16),
                           ("--top-k", args.top_k, 0, 1 << 20), ("--cache-rows", args.cache_rows, 1, 10**8)))
    if args.zoo_examples is not None and not 10 <= args.zoo_examples <= 10**7:
        raise ConfigError(f"--zoo-examples: got {args.zoo_examples}, expected 10..10000000")
    from export.drafters.data import DOMAINS

    domains = [d.strip() for d in args.zoo_domains.split(",") if d.strip()]
    if not domains or set(domains) - set(DOMAINS):
        raise ConfigError(f"--zoo-domains: got {args.zoo_domains!r}, expected a comma-separated subset of "
                          f"{','.join(DOMAINS)}")
    args.zoo_domains = domains
    if args.top_k == 0 and not args.no_cache:
        raise ConfigError("--top-k 0 (the whole distribution) is for --no-cache runs; the cache keeps the top k")
    trainer = registry.trainers()[args.kind]
    if trainer.check is not None:
        trainer.check(args)
    if not args.minutes > 0 or not args.lr > 0:
        raise ConfigError(f"--minutes and --lr must be > 0, got {args.minutes} and {args.lr}")
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        raise ConfigError(f"--target {args.target}: no config.json there; give the target's HF directory")
    if not os.path.isfile(os.path.join(args.target, "tokenizer.json")):
        raise ConfigError(f"--target {args.target}: no tokenizer.json there; the data is tokenized with it")
    if args.data and args.zoo_data != "examples":
        raise ConfigError(f"--zoo-data {args.zoo_data}: the zoo's domains are not used with --data {args.data}; "
                          "drop one of them")
    if args.data:
        from export.drafters.user_data import read_data_file

        read_data_file(args.data, args.keep_answers)  # a malformed line is refused before the target is loaded
    ckpt = os.path.join(args.work or os.path.join("build", "train-drafter", args.kind), "ckpt.pt")
    if args.snapshot and not os.path.isfile(ckpt):
        raise ConfigError(f"--snapshot: {ckpt}: no checkpoint there; give the run's --work (it trains first)")
    taken = [n for n in trainer.out_files if os.path.exists(os.path.join(args.out, n))]
    if taken and not args.force:
        raise ConfigError(f"--out {args.out} already holds {', '.join(taken)}; pass --force to replace them")


def run(args) -> int:
    _check(args)
    from export.drafters.parallel import Dist, resolve_device
    from export.drafters.trainer import TrainConfig, train
    from export.drafters.target import load_target

    def log(msg: str) -> None:
        print(f"[train-drafter {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    device = resolve_device(args.device)
    n = args.zoo_examples or 20000
    cfg = TrainConfig(steps=args.steps, budget_s=60 * args.minutes, lr=args.lr, batch=args.batch,
                      seq_len=args.seq_len, seed=args.seed, threads=args.threads,
                      n_planner=n if "planner" in args.zoo_domains else 0,
                      n_action=max(1, n * 2 // 5) if "action" in args.zoo_domains else 0,
                      n_text=n * 3 // 20 if "text" in args.zoo_domains else 0, top_k=args.top_k, eval_every=args.eval_every,
                      until_plateau=args.until_plateau, patience=args.patience, device=device)
    work = args.work or os.path.join("build", "train-drafter", args.kind)
    cache_dir = args.cache_dir or os.path.join("build", "train-drafter", "cache")
    dist = Dist.from_env(device)
    say = log if dist.rank == 0 else (lambda _m: None)
    import torch

    torch.manual_seed(args.seed)
    target = load_target(args.target, dist.device)
    say(f"target {args.target}: {target.cfg.family}, {target.cfg.num_hidden_layers} layers x {target.cfg.hidden_size}"
        f", vocabulary {target.cfg.vocab_size}, on {dist.device}" + (f" x {dist.world} processes" if dist.world > 1
                                                                      else ""))
    data = _data(args, cfg, target, cache_dir, dist, say)
    task = _task(args, target, say, cfg)
    source, heldout = _sources(args, cfg, target, task, data, cache_dir, dist, say)
    if args.until_plateau and not heldout:
        from runtime.errors import ConfigError

        raise ConfigError("--until-plateau: no held-out rows to judge the plateau by (--data needs 2 or more "
                          "examples: the last of fewer than 20, else every 20th, is held out)")
    result = train(task, target, data, cfg, work, resume=args.resume or args.snapshot, log=log, source=source,
                   heldout=heldout, snapshot=args.snapshot)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank done with the last all-reduce before the group goes (a rank tearing gloo down while its peer
        # still talks to it aborts: "terminate called without an active exception")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if dist.rank != 0:
        return 0
    say(f"{args.kind}: stopped at step {result.steps} ({result.stopped}) after {result.seconds / 60:.1f} min; "
        f"held-out curve in {os.path.join(work, 'curve.json')}")
    config = registry.trainers()[args.kind].config
    extra = config(args, task, target, heldout, say) if config is not None else {}
    return _export_trained(args, task, result, say, extra)


def _data(args, cfg, target, cache_dir, dist, say):
    """The training and held-out rows: --data answered by the target, else the zoo's domains (their example
    texts, or with --zoo-data answers their prompts answered by the target)."""
    from export.drafters.data import build_answered_data, build_token_data, split_heldout
    from export.drafters.user_data import build_user_data

    def build():
        if args.data:
            return build_user_data(args.target, target, args.data, cache_dir, cfg.seed, args.samples,
                                   args.gen_tokens, say, keep_answers=args.keep_answers)
        if args.zoo_data == "answers":
            return build_answered_data(args.target, target, cache_dir, cfg.seed, cfg.n_planner, cfg.n_action,
                                       cfg.n_text, args.samples, args.gen_tokens, say)
        return split_heldout(build_token_data(os.path.join(args.target, "tokenizer.json"), cache_dir, cfg.seed,
                                              cfg.n_planner, cfg.n_action, cfg.n_text, say))

    if dist.rank == 0:  # the others read what rank 0 wrote (the target's answers are not written twice)
        data = build()
    dist.barrier()
    return data if dist.rank == 0 else build()


def _task(args, target, say, cfg):
    task, shape = registry.trainers()[args.kind].task(args, target)
    params = sum(p.numel() for p in task.parameters() if p.requires_grad) / 1e6
    until = "until held-out tau plateaus" if cfg.until_plateau else f"up to {cfg.steps} steps or {args.minutes:g} min"
    say(f"{args.kind}: {shape} ({params:.2f} M params) on {args.target}; {until}, {cfg.batch}x{cfg.seq_len} tokens "
        "a step")
    return task


def _sources(args, cfg, target, task, data, cache_dir, dist, say):
    """(training batch source, held-out batches): from the feature cache, or on the fly with --no-cache."""
    from export.drafters.trainer import LazyBatches, OnTheFly

    has_heldout = any(k.endswith("_heldout") and len(v) for k, v in data.items())
    if args.no_cache:
        held = OnTheFly(data, cfg, target, task.taps, split="heldout") if has_heldout else None
        return None, LazyBatches(held.batch, -(-args.eval_rows // cfg.batch)) if held else []
    from export.drafters.features import CachedSource, FeatureCache, cache_rows, heldout_batches

    root = os.path.join(cache_dir, "features")

    def cache(rows):
        c = FeatureCache(root, target, *rows, cfg.top_k, args.cache_dtype)
        c.fill(task.taps, cfg.batch, dist.rank, dist.world, say)
        dist.barrier()
        c.fill(task.taps, cfg.batch, log=say)  # what another process left (none when all finished)
        return c

    train_cache = cache(cache_rows(data, cfg, args.cache_rows))
    held = heldout_batches(cache(cache_rows(data, cfg, args.eval_rows, split="heldout")), task.taps,
                           cfg.batch, dist.device) if has_heldout else []
    return CachedSource(train_cache, cfg, task.taps, dist.device), held


def _export_trained(args, task, result, log, extra=None) -> int:
    """Write the trained drafter in its official layout, its config naming the target and how it was trained."""
    base = "zoo/target" if args.target.rstrip("/").endswith("zoo/target") else os.path.abspath(args.target)
    training = {"command": "edgespec " + " ".join(sys.argv[1:]), "steps": result.steps,
                "seconds": round(result.seconds, 1), "stopped": result.stopped,
                "final": {k: round(v, 4) for k, v in result.last.items()}}
    if result.curve:
        last = result.curve[-1]
        training["heldout"] = {"step": last["step"], "tau": round(last["tau"], 4),
                               "per_depth": [round(a, 4) for a in last["per_depth"]],
                               "tau_t1": [round(last["tau_t1"], 4), round(last["tau_t1_hi"], 4)]}
    files = task.export(args.out, {**(extra or {}), "base_model_name_or_path": base, "training": training})
    log(f"wrote {', '.join(files)} ({os.path.getsize(files[0]) / 2**20:.1f} MiB)")
    return 0
