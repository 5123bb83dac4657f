"""Process-wide settings a CUDA pipe changes while it is open, and gives back (no GPU needed)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from roundpipe.backends.cuda import GIL_SWITCH, GIL_SWITCH_INTERVAL_S
from roundpipe.backends.held_setting import HeldSetting


@pytest.fixture(autouse=True)
def _switch_interval_kept() -> Iterator[None]:
    found = sys.getswitchinterval()
    yield
    sys.setswitchinterval(found)
    assert GIL_SWITCH.holders == 0


def test_the_gil_switch_interval_is_short_while_a_pipe_holds_it() -> None:
    """The lanes share one GIL: while a CUDA pipe is open a thread that wants it back waits
    0.5 ms at most, not the interpreter's 5 ms; the last pipe to close gives back what was there."""
    sys.setswitchinterval(0.005)
    GIL_SWITCH.acquire()
    GIL_SWITCH.acquire()  # a second pipe
    assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S
    GIL_SWITCH.release()
    assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL_S  # the second is still open
    GIL_SWITCH.release()
    GIL_SWITCH.release()  # one release too many changes nothing
    assert sys.getswitchinterval() == 0.005 and GIL_SWITCH.holders == 0


def test_a_users_own_interval_is_left_alone() -> None:
    """Shorter than ours is kept; one the user sets while a pipe is open stays after it closes."""
    sys.setswitchinterval(0.0001)
    shorter = sys.getswitchinterval()  # as the interpreter keeps it (whole microseconds)
    GIL_SWITCH.acquire()
    assert sys.getswitchinterval() == shorter
    GIL_SWITCH.release()
    sys.setswitchinterval(0.005)
    GIL_SWITCH.acquire()
    sys.setswitchinterval(0.002)
    GIL_SWITCH.release()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_held_setting_sets_from_what_it_found() -> None:
    box = {"value": 3}
    held = HeldSetting(lambda: box["value"], lambda v: box.update(value=v), lambda found: found * 10)
    held.acquire()
    assert box["value"] == 30 and held.holders == 1
    held.release()
    assert box["value"] == 3 and held.holders == 0
