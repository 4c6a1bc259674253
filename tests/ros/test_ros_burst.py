"""A burst of simultaneous requests, far beyond the queue: every request gets an answer (served, or
refused with error_field "queue", or a goal rejected), none is lost in the middleware."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from tests.ros.conftest import HERE, ROOT, start_node

QUEUE_LIMIT = 16
PLANS, ACTIONS, GOALS = 24, 24, 16  # 64 clients, 4x the queue limit


def test_64_simultaneous_clients_are_each_answered_or_refused_and_none_is_lost(tiny_bundle, ros_env, tmp_path):
    # A domain of its own: the discovery of 64 clients must not slow down the other tests' nodes.
    env = {"ROS_DOMAIN_ID": str(random.Random().randint(150, 232))}
    node = start_node(str(tmp_path), "/burst", {"bundle": tiny_bundle, "drafter": "draft_model", "autostart": True,
                                                "queue_limit": QUEUE_LIMIT, "max_context": 1024}, env=env)
    try:
        client = subprocess.run(
            [sys.executable, os.path.join(HERE, "burst_client.py"), "/burst/edgespec", str(PLANS), str(ACTIONS),
             str(GOALS), "60"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300)
        assert client.returncode == 0, client.stdout + client.stderr
        got = json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        rc = node.stop()
    assert rc == 0, node.log()

    assert got["unanswered"] == 0, got
    assert all(field == "queue" and f"queue_limit={QUEUE_LIMIT}" in msg for field, msg in got["refused"]), got
    assert got["served"] + len(got["refused"]) + got["goals_rejected"] == PLANS + ACTIONS + GOALS
    assert got["served"] >= QUEUE_LIMIT, "at least a queue's worth is served"
    assert got["refused"] or got["goals_rejected"], "64 at once must overflow a queue of 16"
    print(f"\nburst of {got['sent']}: {got['served']} served, {len(got['refused'])} refused (queue), "
          f"{got['goals_rejected']} goals rejected, {got['unanswered']} lost")
