"""Redraw the plots beside BENCHMARKS.md from the numbers in docs/img/benchmarks.yaml (each a row of BENCHMARKS.md).

    python scripts/plot_benchmarks.py [--data docs/img/benchmarks.yaml] [--out docs/img]

Writes tau_per_drafter.png (tau on the stand-in at T = 0 and 1) and speedup_per_drafter.png (speedup over plain
decoding at T = 0 on the zoo and the stand-in, with each run's min-max and its none-vs-none control). Small PNGs
(< 60 KB each), so they can live in the repository. Needs matplotlib (pip install edgespec[plot])."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path: str) -> Dict[str, List[dict]]:
    """bundle -> rows as dicts (drafter, T, speedup, range, tau, control, run)."""
    raw = yaml.safe_load(open(path))
    keys = ("drafter", "T", "speedup", "range", "tau", "control", "run")
    out = {}
    for bundle in ("standin", "zoo"):
        rows = [dict(zip(keys, r)) for r in raw[bundle]]
        for r in rows:
            if r["run"] not in raw["runs"]:
                raise SystemExit(f"{path}: row {r['drafter']} names run {r['run']!r}, which `runs:` does not list")
        out[bundle] = rows
    return out


def at(rows: List[dict], temperature: int) -> List[dict]:
    return [r for r in rows if r["T"] == temperature]


def plot_tau(rows: List[dict], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, t1 = at(rows, 0), {r["drafter"]: r for r in at(rows, 1)}
    names = [r["drafter"] for r in t0]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7.5, 3.2), dpi=80)
    ax.bar([i - 0.2 for i in x], [r["tau"] for r in t0], 0.4, label="T = 0 (greedy)", color="#4c72b0")
    ax.bar([i + 0.2 for i in x], [t1[n]["tau"] for n in names], 0.4, label="T = 1", color="#dd8452")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("τ per drafter, robot stand-in (zoo drafters), 2-core CPU", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    path = os.path.join(out, "tau_per_drafter.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_speedup(data: Dict[str, List[dict]], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80, sharey=True)
    for ax, (bundle, title) in zip(axes, (("zoo", "zoo (7 M params, cache-resident)"),
                                          ("standin", "robot stand-in (24 layers, 0.58 GB fp32, memory-bound)"))):
        rows = at(data[bundle], 0)
        x = list(range(len(rows)))
        ax.bar(x, [r["speedup"] for r in rows], 0.6, color="#4c72b0")
        for i, r in enumerate(rows):
            if r["range"]:
                lo, hi = r["range"]
                ax.plot([i, i], [lo, hi], color="black", lw=1)
            if r["control"] is not None:
                ax.plot(i, r["control"], marker="x", color="#c44e52", ms=5, ls="")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(x)
        ax.set_xticklabels([r["drafter"] for r in rows], rotation=40, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("speedup over plain decoding, T = 0")
    axes[1].plot([], [], marker="x", color="#c44e52", ls="", label="that run's control (plain vs plain)")
    axes[1].plot([], [], color="black", lw=1, label="min-max of the rounds")
    axes[1].legend(fontsize=7, loc="lower left", framealpha=0.9)
    fig.tight_layout()
    path = os.path.join(out, "speedup_per_drafter.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "img", "benchmarks.yaml"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_benchmarks: matplotlib is not installed (pip install edgespec[plot])", file=sys.stderr)
        return 2
    data = load(args.data)
    for path in (plot_tau(data["standin"], args.out), plot_speedup(data, args.out)):
        print(f"{path}: {os.path.getsize(path) // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
