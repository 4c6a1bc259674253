"""EAGLE's export side (runtime/drafters/eagle.py): `--eagle DIR` adds an EAGLE-1 head as the drafters eagle
(a chain) and eagle2 (the EAGLE-2 dynamic tree), `--eagle3 DIR` an EAGLE-3 head as eagle3 (dynamic tree) and
eagle3_chain (export/drafters/eagle.py reads the official, vLLM and speculators layouts); their step graph is
export/drafters/eagle_onnx.py's; `train-drafter eagle1|eagle3` trains one (export/drafters/eagle_train.py)."""
from __future__ import annotations

import os

from export.drafters.registry import DrafterExport, Flag, GraphJob, Trainer, check_ranges


def _add(writer, flag: str, path: str, spec):
    from export.drafters.eagle import ZOO_TREE, add_eagle_head

    kind = flag.lstrip("-")  # the flag names the head's kind: eagle | eagle3
    drafters = {"eagle": None, "eagle2": ZOO_TREE} if kind == "eagle" else {"eagle3": ZOO_TREE, "eagle3_chain": None}
    return add_eagle_head(writer, path, spec, kind, drafters=drafters)


def _graphs(job: GraphJob):
    from export.drafters import eagle_kstep, eagle_onnx, head_kstep
    from export.onnx.graph import share_initializers

    out = []
    for name, (drafter, users) in eagle_onnx.bundle_heads(job.bundle, job.target_weights).items():
        grel = f"onnx/drafter.{name}.fp32.onnx"  # one step graph, recorded for each drafter using it
        staged = os.path.join(job.staging, os.path.basename(grel))
        eagle_onnx.export_and_check(drafter, staged, f"{job.bundle.root}/{grel}", job.validate)
        share_initializers(staged, job.target_graph)  # the target's embedding/head
        files, params = [grel, grel + ".data"], dict(eagle_onnx.graph_params(drafter))
        chains = [u for u in users if job.bundle.drafters[u].params.get("tree") is None]
        if job.kstep and chains:  # the K-step chain graph, in the same entry (a dynamic tree never takes it)
            steps = int(job.bundle.drafters[chains[0]].params.get("num_tokens", 4))
            krel = f"onnx/drafter.{name}.kstep{steps}.fp32.onnx"
            kstaged = os.path.join(job.staging, os.path.basename(krel))
            eagle_kstep.export_and_check(drafter, kstaged, steps, f"{job.bundle.root}/{krel}", job.validate)
            share_initializers(kstaged, staged)  # the head's layer, stored once
            share_initializers(kstaged, job.target_graph)
            files += [krel, krel + ".data"]
            params.update(head_kstep.kstep_params(steps, krel, kstaged))
        out += [(user, files, params) for user in users]
    return out


def _arguments(p) -> None:
    p.add_argument("--unroll", type=int, default=4, help="eagle: training-time-test steps (default 4; official 7)")


def _check(args) -> None:
    check_ranges((("--unroll", args.unroll, 1, 16),))


def _trainer(kind: str) -> Trainer:
    def task(args, target):
        from export.drafters.eagle_train import EagleTask

        return (EagleTask(kind, target, unroll=args.unroll),
                f"one layer, training-time test over {args.unroll} steps")

    return Trainer("eagle1" if kind == "eagle" else kind, task, check=_check)


EXPORT = DrafterExport(
    kinds=("eagle", "eagle3"), add=_add, graphs=_graphs, trainers=(_trainer("eagle"), _trainer("eagle3")),
    train_arguments=_arguments,
    flags=(Flag("--eagle", "an EAGLE-1 head (config.json + model.safetensors; official, vLLM or speculators layout): "
                "drafters eagle and eagle2"),
           Flag("--eagle3", "an EAGLE-3 head (same layouts): drafters eagle3 and eagle3_chain")))
