"""`edgespec bench --plot DIR`: the bench table as three PNGs (matplotlib, imported only when asked for).

  speedup.png     speedup over plain decoding per drafter and prompt domain, whiskers = min-max of rounds
  tau_depth.png   tau a drafter would reach drafting k tokens, 1 + sum of its acceptance rates at depths 1..k
  cycle_time.png  milliseconds per cycle split into draft / verify / other, per drafter"""
from __future__ import annotations

import os
from typing import Dict, List

from runtime.errors import ConfigError


def tau_by_draft_length(acceptance_by_depth: List[float]) -> List[float]:
    """tau at draft lengths 0, 1, ..., K from P(accepted >= d | drafted >= d): a cycle commits 1 + the
    accepted drafts, and an accepted length >= d needs depth d accepted, so E = 1 + sum_{d<=k} a_d.

    >>> tau_by_draft_length([0.9, 0.5])
    [1.0, 1.9, 2.4]"""
    out = [1.0]
    for a in acceptance_by_depth:
        out.append(round(out[-1] + a, 10))
    return out


def write_plots(table: List[Dict[str, object]], out_dir: str) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install matplotlib, or pip install -e '.[plot]')")
    os.makedirs(out_dir, exist_ok=True)
    rows = [r for r in table if not r.get("peer") and not r.get("skipped") and r["label"] != "none"]
    temps = sorted({r["temperature"] for r in rows})
    title = f"edgespec bench, bundle {table[0]['bundle']}" + (" (stand-in)" if table[0].get("standin") else "")
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path + ".tmp.png", dpi=110)
        os.replace(path + ".tmp.png", path)  # atomic: a reader never sees half a PNG
        plt.close(fig)
        written.append(path)

    domains = list(rows[0]["by_domain"]) if rows else []
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        sel = [r for r in rows if r["temperature"] == temp]
        width = 0.8 / max(len(domains), 1)
        for j, d in enumerate(domains):
            ys = [r["by_domain"][d]["speedup"] for r in sel]
            lo = [y - r["by_domain"][d]["speedup_min"] for y, r in zip(ys, sel)]
            hi = [r["by_domain"][d]["speedup_max"] - y for y, r in zip(ys, sel)]
            ax.bar([i + j * width for i in range(len(sel))], ys, width, yerr=[lo, hi], capsize=3, label=d)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + width * (len(domains) - 1) / 2 for i in range(len(sel))])
        ax.set_xticklabels([r["label"] for r in sel], rotation=20)
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"T = {temp:g}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save(fig, "speedup.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["acceptance_by_depth"]:
            taus = tau_by_draft_length(r["acceptance_by_depth"])
            ax.plot(range(len(taus)), taus, marker="o", label=f"{r['label']} T={r['temperature']:g}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft length k (tree depth)")
    ax.set_ylabel("tau = tokens per target forward")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save(fig, "tau_depth.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    names = [f"{r['label']}\nT={r['temperature']:g}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in ("draft_ms", "verify_ms", "other_ms"):
        vals = [r[part] for r in rows]
        ax.bar(names, vals, bottom=bottom, label=part[:-3])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per cycle")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend()
    save(fig, "cycle_time.png")
    return written
