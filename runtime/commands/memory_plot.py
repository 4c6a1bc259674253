"""`edgespec memory plan --plot FILE.png`: the plan as a picture (matplotlib, imported only when asked for).
Left: the budget as one stacked bar, a segment per plan row. Right: the longest context that fits against the
budget, one curve per drafter choice, with the plan's budget marked."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

from runtime.memory import plan as memory
from runtime.errors import ConfigError


def context_curve(inp: memory.PlanInputs, budget: int, points: int = 24) -> Tuple[List[float], List[int]]:
    """(budgets in GiB, max context at each) from a quarter to twice `budget`, for the right-hand plot."""
    budgets = [budget * (0.25 + 1.75 * i / (points - 1)) for i in range(points)]
    return [b / memory.GiB for b in budgets], [memory.max_context(inp, int(b)) for b in budgets]


def write_plan_plot(path: str, plan: memory.Plan, curves: Dict[str, memory.PlanInputs], title: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install matplotlib, or pip install -e '.[plot]')")
    fig, (bar, curve) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    bottom = 0.0
    for r in plan.rows:
        gib = r.bytes / memory.GiB
        if gib > 0:
            bar.bar(0, gib, bottom=bottom, label=f"{r.name} {r.bytes / memory.MiB:,.0f} MiB")
            bottom += gib
    bar.axhline(plan.budget / memory.GiB, color="k", ls="--", lw=1, label=f"budget {plan.budget / memory.GiB:.2f} GiB")
    bar.set_xticks([])
    bar.set_ylabel("GiB")
    bar.set_title(f"plan at {plan.context} positions")
    bar.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for name, inp in curves.items():
        xs, ys = context_curve(inp, plan.budget)
        curve.plot(xs, ys, label=name)
    curve.axvline(plan.budget / memory.GiB, color="k", ls="--", lw=1)
    curve.set_xlabel("budget (GiB)")
    curve.set_ylabel("max context (positions)")
    curve.set_title("max context vs budget")
    curve.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)  # atomic: never half a PNG where the user asked for one
    return path
