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


def _burst(tiny_bundle, tmp_path, processes: int, plans: int, actions: int, goals: int, qos: str,
           **params) -> dict:
    """`processes` client processes of (plans, actions, goals) clients each, sending at once: their totals."""
    # A domain of its own: the discovery of many clients must not slow down the other tests' nodes.
    env = {"ROS_DOMAIN_ID": str(random.Random().randint(150, 232))}
    node = start_node(str(tmp_path), "/burst", {"bundle": tiny_bundle, "drafter": "draft_model", "autostart": True,
                                                "queue_limit": QUEUE_LIMIT, "max_context": 1024, **params}, env=env)
    try:
        clients = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "burst_client.py"), "/burst/edgespec", str(plans), str(actions),
             str(goals), "30", qos], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, **env}) for _ in range(processes)]
        outs = [(c.communicate(timeout=300), c.returncode) for c in clients]
    finally:
        rc = node.stop()
    assert rc == 0, node.log()
    total = {"sent": 0, "served": 0, "refused": [], "goals_rejected": 0, "unanswered": 0, "unanswered_by_kind": {}}
    for (out, err), code in outs:
        assert code == 0, out + err
        got = json.loads(out.strip().splitlines()[-1])
        for key, value in got.items():
            if key == "discovery_s":
                total[key] = max(total.get(key, 0.0), value)
            elif key == "unanswered_by_kind":
                for kind, n in value.items():
                    total[key][kind] = total[key].get(kind, 0) + n
            else:
                total[key] += value
    return total


def test_64_simultaneous_clients_are_each_answered_or_refused_and_none_is_lost(tiny_bundle, ros_env, tmp_path):
    got = _burst(tiny_bundle, tmp_path, 1, PLANS, ACTIONS, GOALS, "burst")

    assert got["unanswered"] == 0, got
    assert all(field == "queue" and f"queue_limit={QUEUE_LIMIT}" in msg for field, msg in got["refused"]), got
    assert got["served"] + len(got["refused"]) + got["goals_rejected"] == PLANS + ACTIONS + GOALS
    assert got["served"] >= QUEUE_LIMIT, "at least a queue's worth is served"
    assert got["refused"] or got["goals_rejected"], "64 at once must overflow a queue of 16"
    print(f"\nburst of {got['sent']}: {got['served']} served, {len(got['refused'])} refused (queue), "
          f"{got['goals_rejected']} goals rejected, {got['unanswered']} lost (discovery {got['discovery_s']} s)")


def test_256_default_qos_clients_at_once_each_get_their_answer(tiny_bundle, ros_env, tmp_path):
    """Clients as `ros2 service call` or a plain rclpy client make them (keep last 10 answers), 8 processes of
    32: every one gets its own answer, because the node paces its answers while crowded (edgespec_ros.pacing).
    Unpaced, 9-53 of 256 got nothing: the burst of refusals pushed their answers out of their readers."""
    # 100 ms (the most the parameter allows), not the default 20: 9 client processes and the node share this
    # machine's 2 cores with nothing to spare, and a client process starved for 10 intervals loses an answer
    # however the node paces (docs/ros.md). At 50 ms, 2-3 of 256 went unanswered in 2 of 5 full suite runs
    # (plan / action answers once, goal answers once), never with the file run alone.
    got = _burst(tiny_bundle, tmp_path, 8, 12, 12, 8, "default", answer_interval_s=0.1)
    assert got["unanswered"] == 0, str({**got, "refused": len(got["refused"])})
    assert all(field == "queue" for field, _ in got["refused"]), [r for r in got["refused"] if r[0] != "queue"]
    assert got["served"] + len(got["refused"]) + got["goals_rejected"] == 256
    print(f"\n256 default-QoS clients: {got['served']} served, {len(got['refused'])} refused (queue), "
          f"{got['goals_rejected']} goals rejected, {got['unanswered']} lost (discovery {got['discovery_s']} s)")
