"""DFlash's export side (runtime/drafters/dflash.py): `--dflash DIR` (repeatable) adds an official DFlash or
DFlash-2 drafter (z-lab layout, export/drafters/dflash.py) and one drafter more per smaller trained block size;
its block graph is export/drafters/dflash_onnx.py's; `train-drafter dflash|dflash2` trains one."""
from __future__ import annotations

import os

from export.drafters.registry import DrafterExport, Flag, GraphJob, Trainer, check_ranges


def _add(writer, flag: str, path: str, spec):
    from export.drafters.dflash import add_dflash_drafter  # torch-free, but only bundles with DFlash need it

    return [add_dflash_drafter(writer, path, spec)]


def _graphs(job: GraphJob):
    from export.drafters import dflash_onnx

    out = []
    for name, (args, users) in dflash_onnx.bundle_graphs(job.bundle).items():
        grel = f"onnx/drafter.{name}.fp32.onnx"  # one block graph, recorded for each drafter using it
        dflash_onnx.export_and_check(*args, os.path.join(job.staging, os.path.basename(grel)),
                                     f"{job.bundle.root}/{grel}", *dflash_onnx.embed_and_head(job.target_weights),
                                     validate=job.validate)
        out += [(user, [grel, grel + ".data"], {"precision": "fp32", "graph": "dflash_block"}) for user in users]
    return out


def _arguments(p) -> None:
    p.add_argument("--block-sizes", default="8,16",
                   help="dflash: block lengths trained, the largest is the config's block_size (default 8,16)")
    p.add_argument("--anchors", type=int, default=32, help="dflash: blocks trained per row (default 32)")
    p.add_argument("--selector-rank", type=int, default=64, help="dflash2: candidate selector rank (default 64)")


def _check(args) -> None:
    from runtime.errors import ConfigError

    try:
        sizes = sorted({int(x) for x in args.block_sizes.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or not all(2 <= b <= 64 for b in sizes):
        raise ConfigError(f"--block-sizes: got {args.block_sizes!r}, expected comma-separated block lengths 2..64")
    args.block_sizes = sizes
    check_ranges((("--layers", args.layers, 1, 8), ("--anchors", args.anchors, 1, 4096),
                  ("--selector-rank", args.selector_rank, 1, 4096)))


def _mask_token(target_dir: str) -> int:
    """DFlash's mask token: the zoo's PAD, else the model's pad token, else id 0."""
    from export.bundle.hf_reader import read_hf_prompts
    from runtime.text.prompts import PAD
    from runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(os.path.join(target_dir, "tokenizer.json"))
    for name in (PAD, read_hf_prompts(target_dir, tok).special_tokens.get("pad_token")):
        if name and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return 0


def _trainer(kind: str) -> Trainer:
    def task(args, target):
        from export.drafters.dflash_train import DFlashTask

        task = DFlashTask(kind, target, layers=args.layers, block_size=max(args.block_sizes),
                          block_sizes=args.block_sizes, anchors=args.anchors, mask_token_id=_mask_token(args.target),
                          selector_rank=args.selector_rank)
        return task, (f"{args.layers} layers reading {', '.join(task.taps)}, blocks of "
                      f"{'/'.join(map(str, task.block_sizes))}, {args.anchors} per row")

    return Trainer(kind, task, check=_check)


EXPORT = DrafterExport(
    kinds=("dflash", "dflash2"), add=_add, graphs=_graphs, trainers=(_trainer("dflash"), _trainer("dflash2")),
    train_arguments=_arguments,
    flags=(Flag("--dflash", "official DFlash or DFlash-2 drafter directory (z-lab layout); repeatable, one of each "
                "kind; one drafter <kind>_b<size> more per smaller block in dflash_config.trained_block_sizes",
                repeat=True),))
