"""Batch-1 admission for the node: requests wait in priority order and generate one at a time.

No ROS here, so the ordering rules read (and test) on their own. Each request's callback thread does:

    ticket = queue.join(priority)          # QueueFull when `limit` requests are already in
    try:
        queue.wait_turn(ticket, give_up)   # GaveUp(reason) when give_up() says so first
        ... generate ...
    finally:
        queue.leave(ticket)

Worked example (lower priority value first, FIFO within a priority): while a plan request (1) is
generating, a plan request P2 (1) and then an action request A (0) arrive; A runs next, then P2.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

PRIORITY_ACTIONS = 0
PRIORITY_NORMAL = 1


class QueueFull(Exception):
    """The queue already holds `limit` requests (waiting plus running)."""


class GaveUp(Exception):
    """A waiting request left the queue before its turn; the message is the reason
    ("deadline", "cancelled", or why the node stopped serving)."""


@dataclass(order=True)
class Ticket:
    priority: int
    seq: int
    joined_at: float = field(compare=False)
    started_at: Optional[float] = field(default=None, compare=False)

    @property
    def waited_s(self) -> float:
        end = self.started_at if self.started_at is not None else time.monotonic()
        return end - self.joined_at


class RequestQueue:
    def __init__(self, limit: int, poll_s: float = 0.02):
        self.limit = limit
        self._poll_s = poll_s  # how often a waiter re-checks give_up() (deadline, cancel, deactivation)
        self._cond = threading.Condition()
        self._waiting: List[Ticket] = []  # heap
        self._running: Optional[Ticket] = None
        self._seq = itertools.count()

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting) + (self._running is not None)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None

    def join(self, priority: int) -> Ticket:
        with self._cond:
            size = len(self._waiting) + (self._running is not None)
            if size >= self.limit:
                raise QueueFull(f"{size} requests are queued (queue_limit={self.limit}); retry later")
            ticket = Ticket(priority, next(self._seq), time.monotonic())
            heapq.heappush(self._waiting, ticket)
            return ticket

    def wait_turn(self, ticket: Ticket, give_up: Callable[[], Optional[str]]) -> None:
        """Block until `ticket` is first and nothing runs, then mark it running."""
        with self._cond:
            while not (self._running is None and self._waiting[0] is ticket):
                reason = give_up()
                if reason:
                    self._remove(ticket)
                    raise GaveUp(reason)
                self._cond.wait(self._poll_s)
            heapq.heappop(self._waiting)
            ticket.started_at = time.monotonic()
            self._running = ticket

    def leave(self, ticket: Ticket) -> None:
        with self._cond:
            if self._running is ticket:
                self._running = None
            elif ticket in self._waiting:
                self._remove(ticket)
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is running (for cleanup); True when idle."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, self._poll_s))
            return True

    def _remove(self, ticket: Ticket) -> None:
        self._waiting = [t for t in self._waiting if t is not ticket]
        heapq.heapify(self._waiting)
        self._cond.notify_all()
