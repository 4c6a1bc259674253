"""Specification of `edgespec bench` output: paired (interleaved) measurements, the speedup as the median of
per-round ratios with its min-max, a none-vs-none control row, and stand-in bundles labelled as such.
Timings are never asserted (a shared 2-core machine); only the shape and the bookkeeping are."""
import json
import os
import shutil

import pytest

from runtime.commands.bench import CONTROL, paired_speedup
from tests.test_cli import run_cli

FAST = ["--domains", "planner", "--max-tokens", "6", "--rounds", "1"]


def test_paired_speedup_is_the_median_of_per_round_ratios_with_min_and_max():
    got = paired_speedup([80.0, 84.0, 30.0], [40.0, 38.0, 20.0])
    assert got["speedup"] == 2.0 and got["speedup_min"] == 1.5 and got["speedup_max"] == pytest.approx(84 / 38)
    assert got["speedup_per_round"] == pytest.approx([2.0, 84 / 38, 1.5])


def test_bench_json_has_every_config_per_temperature_a_control_row_and_the_spread(tiny_bundle, capsys):
    code, out, err = run_cli(["bench", "--bundle", tiny_bundle, "--drafters", "ngram,draft_model",
                              "--temperatures", "0,1", "--json"] + FAST, capsys)
    rows = json.loads(out)
    assert code == 0 and "round 1/1 done" in err
    assert [(r["label"], r["temperature"]) for r in rows] == [
        (label, t) for t in (0.0, 1.0) for label in ("none", "ngram", "draft_model", CONTROL)]
    for r in rows:
        assert r["rounds"] == 1 and len(r["speedup_per_round"]) == 1
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
        assert r["control"] == (r["label"] == CONTROL) and r["standin"] is False and r["bundle"] == "tiny"
        assert r["identical_to_plain"] is (True if r["temperature"] == 0 else None)
    base = [r for r in rows if r["label"] == "none"]
    assert all(r["speedup"] == 1.0 and r["tau"] == 1.0 for r in base)
    control = [r for r in rows if r["control"]]
    assert all(r["drafter"] == "none" and r["tau"] == 1.0 for r in control)


def test_a_standin_bundle_is_labelled_as_a_stand_in(tiny_bundle, tmp_path, capsys):
    copy = str(tmp_path / "tiny-standin")
    shutil.copytree(tiny_bundle, copy)
    manifest = os.path.join(copy, "bundle.yaml")
    text = open(manifest).read()
    open(manifest, "w").write(text.replace("name: tiny\n", "name: tiny-standin\n", 1))
    code, out, _ = run_cli(["bench", "--bundle", copy, "--drafters", "ngram"] + FAST, capsys)
    assert code == 0 and "STAND-IN" in out and "ngram *" in out and "* stand-in rows" in out
    assert f"{CONTROL} *" in out
