"""MTP's export side (runtime/drafters/mtp.py): a target's own MTP module becomes the `mtp` drafter when the
bundle is built (export/bundle/builder.py splits it from the target's weights); `--mtp DIR` adds one trained for
a target without one; its graphs are export/drafters/mtp_onnx.py's; `train-drafter mtp` trains it."""
from __future__ import annotations

from export.drafters.registry import DrafterExport, Flag, GraphJob, Trainer


def _add(writer, flag: str, path: str, spec):
    from export.bundle.builder import add_mtp_weights, external_mtp

    own = {"mtp": writer.manifest["drafters"]["mtp"]} if "mtp" in writer.manifest["drafters"] else {}
    add_mtp_weights(writer, external_mtp(path, spec, own), spec)
    return ["mtp"]


def _graphs(job: GraphJob):
    from export.drafters.mtp_onnx import export_bundle_mtp
    from export.onnx.graph import safetensors_weights

    b = job.bundle
    return [(m.name, m.files, m.params) for m in (
        export_bundle_mtp(b, name, d, job.target_weights, job.staging, job.target_graph, job.precision, job.validate,
                          safetensors_weights(b, d.files), job.kstep)
        for name, d in b.drafters.items() if d.kind == "mtp")]


def _task(args, target):
    from export.drafters.mtp_train import MTPTask

    task = MTPTask(target)
    return task, f"one DeepSeek-V3-style module (a {target.cfg.family} layer) reading {task.taps[0]}"


EXPORT = DrafterExport(
    kinds=("mtp",), add=_add, graphs=_graphs, trainers=(Trainer("mtp", _task),),
    flags=(Flag("--mtp", "an MTP module trained for a target that has none (`edgespec train-drafter mtp --target DIR "
                "--out DIR`: model.safetensors with DeepSeek-V3 keys model.layers.N.*): the `mtp` drafter"),))
