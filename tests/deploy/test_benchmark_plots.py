"""The plots beside BENCHMARKS.md are drawn from numbers BENCHMARKS.md states, and redraw small."""
from __future__ import annotations

import os

import pytest

from tests.support import REPO_ROOT

BENCHMARKS = os.path.join(REPO_ROOT, "BENCHMARKS.md")
DATA = os.path.join(REPO_ROOT, "docs", "img", "benchmarks.yaml")


def load():
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_benchmarks", os.path.join(REPO_ROOT, "scripts",
                                                                                  "plot_benchmarks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bundle", ["standin", "zoo"])
def test_every_row_of_the_plot_data_is_a_row_of_benchmarks_md(bundle):
    text = open(BENCHMARKS, encoding="utf-8").read()
    for r in load().load(DATA)[bundle]:
        cell = f"{r['speedup']:.2f}x" + (" [{:.2f}–{:.2f}]".format(*r["range"]) if r["range"] else "")
        cell = f"**{cell}**" if f"**{cell}**" in text else cell
        assert f"| {cell} | {r['tau']:.2f} |" in text, (r["drafter"], r["T"], cell)


def test_the_plots_redraw_from_the_data_file_each_under_60_kb(tmp_path):
    pytest.importorskip("matplotlib")
    assert load().main(["--out", str(tmp_path)]) == 0
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert set(sizes) == {"tau_per_drafter.png", "speedup_per_drafter.png"}
    assert all(size < 60 * 1024 for size in sizes.values()), sizes


def test_a_row_naming_an_unlisted_run_is_refused(tmp_path):
    bad = tmp_path / "data.yaml"
    bad.write_text("runs: {}\nstandin:\n  - [ngram, 0, 1.3, [1.2, 1.4], 1.6, 1.0, nowhere]\nzoo: []\n")
    with pytest.raises(SystemExit, match="nowhere"):
        load().load(str(bad))
