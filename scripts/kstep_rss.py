"""Resident memory a drafter's K-step graph adds: one fresh process per (drafter, mode) opens a session on a copy of
bundle B with params.kstep set, generates 8 tokens, and prints the growth of VmRSS since before the open, and the
plan's "drafter K-step graph" row for the same session. The K-step session's cost is the "on" row less the "off" row.

    for d in draft_model eagle3_chain mtp; do for m in off on; do
        PYTHONPATH=$PWD python scripts/kstep_rss.py B $d $m; done; done
(B must hold K-step graphs: `edgespec export --to onnx --bundle B --kstep on`.)
"""
import os
import shutil
import sys
import tempfile

from runtime.memory import plan as memory
from runtime.serving.session import GenerationParams, Session
from tests.support.kstep import set_kstep


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main(bundle: str, drafter: str, mode: str) -> None:
    with tempfile.TemporaryDirectory() as work:
        root = os.path.join(work, "b")
        shutil.copytree(bundle, root)
        set_kstep(root, [drafter], mode)
        import onnxruntime  # noqa: F401  (the library's own pages are not the session's)
        before = rss_mib()
        s = Session.open(root, drafter=drafter, backend="onnx", max_context=256)
        s.generate("pick up the red cup", GenerationParams(max_tokens=8))
        grown = rss_mib() - before
        rows = {r.name: r.bytes for r in memory.plan_rows(s.plan_inputs, 64, 2**30)}
        print(f"{drafter} kstep {mode}: VmRSS +{grown:.1f} MiB, paths {s.drafter.draft_paths}, planned K-step row "
              f"{rows.get('drafter K-step graph', 0) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:4])
