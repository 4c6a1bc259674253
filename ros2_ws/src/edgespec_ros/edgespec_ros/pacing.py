"""Answers leave a service no closer together than `interval_s`, so no default-QoS client loses its own.

Why: a ROS 2 service has one response topic; every client's response reader receives every answer the
service sends (rmw_fastrtps' take discards those meant for other clients, one sample per take), and a
default client keeps only the last 10 (KEEP_LAST 10). A burst of fast answers (`queue` refusals take
microseconds) pushes a client's own answer out of its reader before its executor takes it: 9-53 of 256
default-QoS clients (8 processes of 32) got nothing though the node answered all 256. Paced at 20 ms: 0
in most runs, 1 in a run on a shared 2-core machine at load 8 (at 10 ms: up to 22 there).

The node cannot deepen the clients' readers, so it paces what it sends while it is crowded: a client
that takes a sample per `interval_s` keeps up, one late by less than 10 intervals loses nothing. With at
most QUIET_CROWD requests in the node their answers cannot overrun a 10-deep reader even all at once, so
they leave unpaced: a control loop calling back to back never waits for a slot. A process holding many default-QoS clients of one service takes
one sample per client per round (each sees every answer), so it falls behind any sane pace: such a
process needs edgespec_ros.qos.REQUEST_QOS (1 process of 256: 155 lost, paced or not).

Worked example (interval 20 ms, 30 requests in the node): refusals ready at t = 0, 0, 0 leave at t = 0, 20,
40 ms; an answer ready at t = 100 ms leaves at once; with 1 request in the node, answers never wait.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


QUIET_CROWD = 4  # requests in the node (taken, not answered) up to which answers leave unpaced


class AnswerPacer:
    """Thread-safe: each caller of wait() gets the next free slot and sleeps until it."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.interval_s = interval_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._next = float("-inf")  # the earliest time the next answer may leave

    def slot(self, crowd: int = QUIET_CROWD + 1) -> float:
        """Reserve the next slot: max(now, previous slot + interval) while `crowd` (requests in the node)
        exceeds QUIET_CROWD, else now; either way the next paced answer keeps its distance from this one."""
        with self._lock:
            now = self._clock()
            at = max(now, self._next) if crowd > QUIET_CROWD else now
            self._next = max(self._next, at + self.interval_s)
            return at

    def wait(self, crowd: int = QUIET_CROWD + 1) -> None:
        delay = self.slot(crowd) - self._clock()
        if delay > 0:
            self._sleep(delay)
