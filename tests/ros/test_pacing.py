"""The answer pacer (edgespec_ros.pacing): no ROS, a fake clock."""
from __future__ import annotations

import threading

from edgespec_ros.pacing import QUIET_CROWD, AnswerPacer


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        with self.lock:
            self.now += s


def test_a_burst_of_answers_leaves_one_interval_apart_and_a_lone_answer_leaves_at_once():
    clock = FakeClock()
    pacer = AnswerPacer(0.005, clock=clock, sleep=clock.sleep)
    assert [pacer.slot() for _ in range(3)] == [0.0, 0.005, 0.010]
    clock.now = 0.020
    assert pacer.slot() == 0.020


def test_wait_sleeps_until_the_reserved_slot_and_interval_zero_never_sleeps():
    clock = FakeClock()
    pacer = AnswerPacer(0.005, clock=clock, sleep=clock.sleep)
    pacer.wait()
    pacer.wait()
    assert clock.now == 0.005
    unpaced = AnswerPacer(0.0, clock=clock, sleep=lambda s: (_ for _ in ()).throw(AssertionError(s)))
    for _ in range(5):
        unpaced.wait()


def test_threads_get_distinct_slots():
    pacer = AnswerPacer(0.001)
    slots, lock = [], threading.Lock()

    def take():
        for _ in range(50):
            s = pacer.slot()
            with lock:
                slots.append(s)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    slots.sort()
    # slots are monotonic-clock seconds (~1e4-1e6): one float ulp there is ~1e-12..1e-10, so allow 1e-9
    assert all(b - a >= 0.001 - 1e-9 for a, b in zip(slots, slots[1:]))


def test_a_quiet_node_answers_at_once_and_a_crowded_one_paces_after_its_last_answer():
    clock = FakeClock()
    pacer = AnswerPacer(0.020, clock=clock, sleep=clock.sleep)
    assert [pacer.slot(crowd=1) for _ in range(3)] == [0.0, 0.0, 0.0]  # a control loop back to back
    assert pacer.slot(crowd=QUIET_CROWD) == 0.0
    assert [pacer.slot(crowd=30) for _ in range(2)] == [0.020, 0.040]  # a burst: spaced from the last answer
