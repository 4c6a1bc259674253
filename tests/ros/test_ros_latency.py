"""The control-loop latency tool (`python -m edgespec_ros.latency`) in its short mode, against a speculative
and a plain node on the tiny bundle: every scenario on both nodes, every call answered and accounted for.
No timing is asserted (shared CI machines): only that the numbers are there and add up."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from edgespec_ros.latency import METRICS, SCENARIOS, Call, speedups, summarize
from tests.ros.conftest import ROOT, start_node


def test_summary_gives_percentiles_per_metric_and_counts_deadline_misses():
    calls = [Call("/n", "probe@10Hz", i, 0.0, rtt_s=0.01 * (i + 1), gen_s=0.005, queue_s=0.0, ttft_s=0.004,
                  overhead_s=0.01 * (i + 1) - 0.005, tokens=1, success=True, missed=i >= 9) for i in range(10)]
    calls.append(Call("/n", "probe@10Hz", 10, 0.0, message="no answer", missed=True))
    s = summarize(calls, 0.1)
    assert s["calls"] == 11 and s["answered"] == 10 and s["failed"] == 1 and s["deadline_misses"] == 2
    assert s["rtt_s"]["p50"] == pytest.approx(0.055) and s["rtt_s"]["max"] == pytest.approx(0.1)
    assert s["rtt_s"]["p50"] <= s["rtt_s"]["p90"] <= s["rtt_s"]["p99"] <= s["rtt_s"]["max"]
    assert set(s) >= set(METRICS)


def test_speedup_lines_compare_the_robots_round_trip_with_the_decoding_speedup():
    def row(node, rtt, gen):
        return {"node": node, "scenario": "generate@2Hz", "rtt_s": {"p50": rtt}, "gen_s": {"p50": gen}}

    # decoding 2x faster, but a 10 ms fixed cost per goal on both nodes: the robot feels 1.82x
    got = speedups({"rows": [row("/spec", 0.060, 0.050), row("/plain", 0.110, 0.100)]})
    assert [g["scenario"] for g in got] == ["generate@2Hz"]
    assert got[0]["gen_speedup"] == pytest.approx(2.0) and got[0]["rtt_speedup"] == pytest.approx(0.110 / 0.060)
    assert got[0]["ratio"] == pytest.approx((0.110 / 0.060) / 2.0)
    assert speedups({"rows": [row("/spec", 0.06, 0.05)]}) == []  # one node: nothing to compare


@pytest.mark.slow
def test_latency_tool_short_mode_measures_both_nodes_in_every_scenario(tiny_bundle, ros_env, tmp_path):
    params = {"bundle": tiny_bundle, "autostart": True, "max_context": 1024, "default_max_tokens": 16}
    nodes = [start_node(str(tmp_path), "/lat_spec", {**params, "drafter": "draft_model"}),
             start_node(str(tmp_path), "/lat_plain", {**params, "drafter": "none"})]
    out_json = tmp_path / "latency.json"
    try:
        run = subprocess.run([sys.executable, "-m", "edgespec_ros.latency", "--spec", "/lat_spec/edgespec",
                              "--plain", "/lat_plain/edgespec", "--short", "--json", str(out_json), "--timeout", "90"],
                             cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=240)
    finally:
        rcs = [n.stop() for n in nodes]
    assert run.returncode == 0, run.stdout + run.stderr + "".join(n.log() for n in nodes)
    assert rcs == [0, 0], "".join(n.log() for n in nodes)
    assert "ROS/node overhead" in run.stdout and "/lat_plain/edgespec" in run.stdout
    got = json.loads(out_json.read_text())
    rows = {(r["node"], r["scenario"]): r for r in got["rows"]}
    assert set(rows) == {(n, s) for n in ("/lat_spec/edgespec", "/lat_plain/edgespec") for s in SCENARIOS}
    assert [sp["scenario"] for sp in got["speedups"]] == list(SCENARIOS)
    assert "round-trip speedup / generation speedup" in run.stdout
    for row in rows.values():
        assert row["calls"] >= 1 and row["answered"] + row["failed"] == row["calls"]
        assert row["answered"] >= 1, row
        for m in METRICS:
            assert set(row[m]) == {"p50", "p90", "p99", "max"}, (m, row)
    for c in got["calls"]:
        if c["success"]:  # (a request whose deadline passed while queued is answered with nothing generated)
            assert c["rtt_s"] > 0 and (c["gen_s"] > 0 or c["finish_reason"] == "deadline")
            assert c["ttft_s"] <= c["gen_s"]
            assert c["overhead_s"] == pytest.approx(c["rtt_s"] - c["queue_s"] - c["gen_s"])
            assert c["missed"] == (c["rtt_s"] > SCENARIOS[c["scenario"]].period_s or c["finish_reason"] == "deadline")
        else:
            assert c["message"] and c["missed"] or not math.isnan(c["rtt_s"])


def test_plot_without_matplotlib_is_refused_up_front_with_what_to_install(capsys, monkeypatch):
    import importlib.util

    from edgespec_ros.latency import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:  # refused before any node is looked for
        main(["--plot", "latency.png", "--spec", "/nowhere/edgespec", "--plain", ""])
    assert exc.value.code == 2 and "pip install matplotlib" in capsys.readouterr().err
