"""Helpers of the K-step graph tests (tests/runtime/drafters/test_*_kstep.py)."""
import os

import yaml


def set_kstep(root: str, names, mode: str) -> None:
    """Set params.kstep of the named drafters in the bundle at `root` (bundle.yaml is not a sealed file)."""
    path = os.path.join(root, "bundle.yaml")
    with open(path) as f:
        m = yaml.safe_load(f)
    for name in names:
        m["drafters"][name]["params"] = {**(m["drafters"][name].get("params") or {}), "kstep": mode}
    with open(path, "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)


def loaded_weight_bytes(graph_path: str) -> int:
    """Bytes of every weight of an ONNX graph, loaded with its external data as ONNX Runtime loads it (an account
    independent of the export's record: each initializer's and constant's array, wherever its bytes lie)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(graph_path)  # with every external data file it references
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return sum(numpy_helper.to_array(t).nbytes for t in tensors)


def kstep_row(inputs) -> int:
    """The memory plan's "drafter K-step graph" row of PlanInputs `inputs` (0: none), at any context and budget."""
    from runtime.memory import plan as memory

    return {r.name: r.bytes for r in memory.plan_rows(inputs, 64, 2**30)}.get("drafter K-step graph", 0)
