"""Medusa's export side (runtime/drafters/medusa.py): `--medusa PATH` adds the heads (export/drafters/medusa.py) as
the drafters medusa and medusa_chain, their one graph is export/drafters/medusa_onnx.py's, `train-drafter medusa`
trains them and tunes their tree."""
from __future__ import annotations

from export.drafters.registry import DrafterExport, Flag, GraphJob, Trainer, check_ranges
from runtime.errors import BundleError

NAMES = ("medusa", "medusa_chain")


def _add(writer, flag: str, path: str, spec):
    from export.drafters.medusa import add_medusa_to_bundle

    taken = [n for n in NAMES if n in writer.manifest["drafters"]]
    if taken:
        raise BundleError(f"{writer.root}: already has a drafter {taken[0]!r}; remove it first "
                          f"(`edgespec bundle remove-drafter --bundle {writer.root} {' '.join(NAMES)}`)")
    return add_medusa_to_bundle(writer, path, spec)


def _graphs(job: GraphJob):
    from export.drafters.medusa_onnx import export_medusa_graphs

    return [(name, [grel, grel + ".data"], params)  # medusa and medusa_chain share one graph; fp32 only
            for name, grel, params in export_medusa_graphs(job.bundle, job.staging, job.precision, job.validate)]


def _task(args, target):
    from export.drafters.medusa import medusa_task

    return medusa_task(target, args.heads, args.layers), f"{args.heads} heads x {args.layers} ResBlocks"


def _arguments(p) -> None:
    p.add_argument("--heads", type=int, default=4, help="medusa: number of heads, 1..16 (default 4)")
    p.add_argument("--tree-nodes", type=int, default=32,
                   help="medusa: nodes at most of the tree tuned on the trained heads (default 32; 0 = no tree)")


def _check(args) -> None:
    check_ranges((("--heads", args.heads, 1, 16), ("--tree-nodes", args.tree_nodes, 0, 256)))


def _config(args, task, target, heldout, say) -> dict:
    """The medusa config keys: the heads' shape, and the tree tuned on held-out accuracies."""
    from export.drafters.medusa import accuracy_report, measure_accuracy, top_k_accuracy, tune_tree

    config = {"medusa_num_heads": args.heads, "medusa_num_layers": args.layers,
              "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size}
    if args.tree_nodes and heldout:
        acc = measure_accuracy(task, heldout)
        choices, tau = tune_tree(acc, args.tree_nodes)
        say("accuracy per head on held-out batches (top-k: the target's token among the head's k best; "
            "rank-i: it is the head's i-th candidate, what the tree search weighs): "
            + "; ".join(accuracy_report(acc)))
        say(f"tuned tree: {len(choices)} nodes, expected tau {tau:.2f} (greedy, independence assumed)")
        config["medusa_choices"] = choices
        config["tree_tuning"] = {"accuracy_by_rank": [[round(float(a), 4) for a in row[:5]] for row in acc],
                                 "top_k_accuracy": [[round(float(a), 4) for a in row[:5]] for row in top_k_accuracy(acc)],
                                 "expected_tau": round(tau, 3), "max_nodes": args.tree_nodes}
    return config


EXPORT = DrafterExport(
    kinds=("medusa",), add=_add, graphs=_graphs, train_arguments=_arguments,
    trainers=(Trainer("medusa", _task, out_files=("medusa_lm_head.safetensors", "config.json"), check=_check,
                      config=_config),),
    flags=(Flag("--medusa", "Medusa heads for the target: a Medusa-1 head file (medusa_lm_head.safetensors, or .pt "
                "read with weights_only), its directory, or a Medusa-2 checkpoint (heads under medusa_head.); adds "
                "the drafters medusa (a tree) and medusa_chain", metavar="PATH"),))
