"""`make demo`'s ROS part end to end: our launcher starts the speculative and the plain node on the
zoo bundle as their own processes, and the demo client exercises every interface against them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.ros.conftest import ROOT

ZOO = os.path.join(ROOT, "build", "bundles", "zoo")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(ZOO, "bundle.yaml")),
                    reason="no zoo bundle at build/bundles/zoo: run `make bundles`")
def test_demo_client_runs_every_interface_against_launched_nodes(ros_env):
    out = subprocess.run([sys.executable, "-m", "edgespec_ros.demo_client", "--launch",
                          "configs/ros/demo_launch.yaml", "--timeout", "90"],
                         cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=240)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    for section in ("== Plan", "== ActionTokens", "== Generate", "speedup vs plain decoding"):
        assert section in log, log
    assert "greedy outputs identical: True" in log, log
