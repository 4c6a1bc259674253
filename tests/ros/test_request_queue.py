"""The node's batch-1 admission rules, without ROS: priority then arrival order, a size limit, and
waiters that leave (deadline, cancel) without blocking the others."""
from __future__ import annotations

import threading
import time

import pytest

from edgespec_ros.request_queue import PRIORITY_ACTIONS, PRIORITY_NORMAL, GaveUp, QueueFull, RequestQueue


def test_waiters_are_served_by_priority_then_arrival_one_at_a_time():
    q = RequestQueue(limit=8, poll_s=0.005)
    running = q.join(PRIORITY_NORMAL)
    q.wait_turn(running, lambda: None)
    served, threads = [], []
    for name, prio in (("plan1", PRIORITY_NORMAL), ("plan2", PRIORITY_NORMAL), ("act", PRIORITY_ACTIONS)):
        ticket = q.join(prio)

        def serve(ticket=ticket, name=name):
            q.wait_turn(ticket, lambda: None)
            served.append(name)
            q.leave(ticket)

        threads.append(threading.Thread(target=serve))
        threads[-1].start()
    time.sleep(0.05)
    assert served == [] and len(q) == 4
    q.leave(running)
    for t in threads:
        t.join(timeout=5)
    assert served == ["act", "plan1", "plan2"]
    assert len(q) == 0


def test_a_full_queue_refuses_and_a_waiter_can_give_up():
    q = RequestQueue(limit=2, poll_s=0.005)
    first = q.join(PRIORITY_NORMAL)
    q.wait_turn(first, lambda: None)
    second = q.join(PRIORITY_NORMAL)
    with pytest.raises(QueueFull, match="queue_limit=2"):
        q.join(PRIORITY_ACTIONS)
    with pytest.raises(GaveUp, match="deadline"):
        q.wait_turn(second, lambda: "deadline")
    assert len(q) == 1  # the waiter that gave up left; the running one stays
    q.leave(first)
    assert q.wait_idle(0.1)
