"""`edgespec tune --plot DIR`: the tune as three PNGs (matplotlib, imported only when asked for).

  cost.png         verify seconds by rows, in units of one plain step (how much a drafted node costs to check)
  calibration.png  acceptance against the drafter's path confidence, per drafter, greedy and sampled (the table
                   the per-node rule reads; the diagonal is a perfectly calibrated drafter)
  rates.png        tokens per second the cost model expected of each measured shape against what it ran at"""
from __future__ import annotations

import os
from typing import Dict, List

from runtime.errors import ConfigError
from runtime.speculation import Calibration


def write_tune_plots(entry: Dict, out_dir: str) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install matplotlib, or pip install -e '.[plot]')")
    os.makedirs(out_dir, exist_ok=True)
    machine = entry.get("machine") or {}
    title = f"edgespec tune, {entry['backend']} {entry['precision']}, {machine.get('cpu', '?')}"
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)  # atomic: never half a PNG where the user asked for one
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    step = entry["verify"][0][1]
    ax.plot([n for n, _ in entry["verify"]], [s / step for _, s in entry["verify"]], marker="o")
    ax.set_xlabel("verify rows (root + drafted nodes)")
    ax.set_ylabel("seconds / one plain step")
    ax.set_title(f"verify cost (one step = {step * 1e3:.2f} ms)")
    ax.grid(alpha=0.3)
    save(fig, "cost.png")

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, cls in zip(axes, ("greedy", "sampled")):
        for name, d in entry["drafters"].items():
            table = (d.get("calibration") or {}).get(cls)
            if not table:
                continue
            cal = Calibration.from_dict(table, f"drafters.{name}.calibration.{cls}")
            xs, ys = cal.table()
            seen = [x for x, n in zip(xs, cal.drafted) if n > 0]
            ax.plot(xs, ys, label=name)
            ax.scatter(seen, [cal(x) for x in seen], s=8)
        ax.plot([0, 1], [0, 1], color="k", ls="--", lw=0.8)
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlabel("path confidence (drafter's probability of the path)")
        ax.set_title(f"acceptance vs confidence, {cls}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("P(node accepted)")
    axes[1].legend(fontsize=7)
    save(fig, "calibration.png")

    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = 0.0
    for name, d in entry["drafters"].items():
        pts = [(t["expected_tok_s"], t["measured_tok_s"]) for t in d["templates"].values()
               if t.get("expected_tok_s") and t.get("measured_tok_s")]
        if pts:
            ax.scatter(*zip(*pts), label=name, s=14)
            top = max(top, *(max(p) for p in pts))
    ax.plot([0, top], [0, top], color="k", ls="--", lw=0.8)
    ax.set_xlabel("expected tokens/s (cost model, measured shape)")
    ax.set_ylabel("measured tokens/s (decode, prefill excluded)")
    ax.set_title("expected vs measured, per drafter and template")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save(fig, "rates.png")
    return written
