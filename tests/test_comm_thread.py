"""The collectives thread keeps one order whatever order gradients become complete in, and hands
a failure to whoever waits. No process group: the work is recorded, not communicated."""

from __future__ import annotations

import threading

import pytest

from roundpipe.optim.comm_thread import OrderedCollectives


def recorder(fail_at: tuple[int, int] | None = None) -> tuple[OrderedCollectives, list[tuple[int, int]]]:
    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def average(step: int, unit: int) -> None:
        if (step, unit) == fail_at:
            raise RuntimeError("peer gone")
        with lock:
            done.append((step, unit))

    def check(step: int) -> None:
        with lock:
            done.append((step, -1))

    thread = OrderedCollectives([4, 2, 0], average, check, lambda step: step == 1, idle_s=5.0)
    return thread, done


def test_units_are_averaged_deepest_first_whatever_order_they_complete_in() -> None:
    thread, done = recorder()
    thread.after_g_copy(0, 0)  # the shallow unit's G-copy ran before step() was called
    thread.step_scheduled(0, last_iteration=0)
    thread.after_g_copy(0, 2)
    thread.after_g_copy(0, 4)
    thread.wait("done", 0, 0)
    thread.step_scheduled(1, last_iteration=2)
    thread.after_g_copy(1, 4)  # iteration 1 is not the step's last: not ready yet
    for unit in (0, 2, 4):
        thread.after_g_copy(2, unit)
    thread.wait("done", 1, 0)
    thread.stepped(1)
    thread.wait("checked", 1)
    assert done == [(0, 4), (0, 2), (0, 0), (1, 4), (1, 2), (1, 0), (1, -1)]


def test_a_failed_average_is_raised_to_the_waiting_step() -> None:
    thread, done = recorder(fail_at=(0, 2))
    thread.step_scheduled(0, last_iteration=0)
    for unit in (0, 2, 4):
        thread.ready(0, unit)
    thread.wait("done", 0, 4)
    with pytest.raises(RuntimeError, match="peer gone"):
        thread.wait("done", 0, 0)
    assert done == [(0, 4)]
