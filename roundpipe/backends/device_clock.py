"""One device's event times on the host clock: one monotone map per device.

Why this exists: the CUDA backend times every task with two events on the device and reports
the times on the host's millisecond clock, as a base event's host time plus the events' elapsed
time since it. The two clocks drift apart (about 0.2 ms in 96 s was seen on an H200, the GPU's
ahead), so a mapped end can lie after the moment the host saw the task end, and a host task that
waited for it (a G-copy after its gradient download) would seem to start before its dependency
ended. Each end must therefore be bounded by its task's observation.

Bounding each task by its own observation alone breaks the order *on* the device: two lanes
have two waiter threads, one may see its task late and the other early, and a copy that the
GPU started right after a compute ended could be pulled back further than that compute, before
it (seen on an H200: an activation download 13 us before its compute's end, 13 s into a run).

So every time on one device goes through one non-decreasing map

    f(g) = min(base + g, min{observed_i : end_i >= g})

over the observations (end_i, observed_i) of that device's tasks: the largest non-decreasing map
under the GPU's own reading that puts no end after its observation. Non-decreasing keeps the
device's order (an end before a start on the GPU stays so on the host), the bound keeps the
host's. Observations are taken under one lock, so they arrive in increasing order; then only
those with an end later than every earlier one matter, a list increasing in both, and a time
placed once never needs lowering when later observations arrive: the map is computed online.

The GPU's clock can also run behind the host's (an H200 run placed a parameter upload 15 us
before the host's P-copy it waited for ended, 49 s in). A task cannot start on the device before
the host issued it, so each task also brings a lower bound: its start is no earlier than its
issue.

Both bounds move one offset, the *shift* added to the GPU's reading, rather than bending the map
point by point: a start before its issue shifts the reading later, an end after its observation
shifts it earlier, each by the least amount that meets the bound. Clamping each point alone
flattens the map wherever the reading runs ahead (every time between two observed ends lands on
the later observation), and with it the lengths of the tasks there: on an H200, whose base event
is read about 0.4 ms late (its host time is taken after a synchronize) and whose clock then ran
ahead by another 0.1 ms in 13 s, the mapped trace of workload A lost 84 ms of compute in three
iterations, and its bubble read 4.4% where the device's own clock gives 1.96%. A shift keeps
each task's length as the GPU measured it; the per-point bounds above stay, as a safety net for
what the shift has not caught up with. Every time is also kept between the times already placed
before and after it on the device (the placed points, a list increasing in both), so the
device's order holds whatever the shift does; where the bounds and the order cannot all hold, the
order wins.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

# Observations older than this are dropped: no task is seen this long after its end, and a
# dropped one could only loosen the bound, never misplace an order the GPU enforced.
KEEP_OBSERVED_MS = 60_000.0


@dataclass(frozen=True)
class DeviceClockStatistics:
    """What one device's map has done so far: ``device_ms`` is the summed task lengths as the GPU
    measured them, ``mapped_ms`` as placed on the host clock; ``lost_ms`` (their difference) is
    what the map took from the tasks (time a trace's bubble would wrongly count), ``shift_ms``
    how far the GPU's reading is now moved (later: > 0)."""

    tasks: int
    device_ms: float
    mapped_ms: float
    shift_ms: float

    @property
    def lost_ms(self) -> float:
        return self.device_ms - self.mapped_ms


class DeviceClock:
    """Places one device's event times on the host clock; see the module docstring.

    ``base_ms`` is the host time of the device's base event; `place` takes a task's start and
    end as elapsed milliseconds since that event and returns them on the host clock.
    """

    def __init__(self, base_ms: float, now: Callable[[], float]) -> None:
        self.base_ms = base_ms
        self._now = now
        self._lock = threading.Lock()
        self._shift = 0.0  # added to the device's reading: how far it was seen to run behind (> 0) or ahead
        self._ends: list[float] = []  # device ends of the kept observations, increasing
        self._observed: list[float] = []  # their host observations, increasing
        self._at: list[tuple[float, bool]] = []  # device times placed so far (and: a start?), increasing
        self._placed: list[float] = []  # where they were placed, non-decreasing
        self._tasks, self._device_ms, self._mapped_ms = 0, 0.0, 0.0  # for `statistics`

    def place(
        self, start_elapsed_ms: float, end_elapsed_ms: float, issued_ms: float | None = None
    ) -> tuple[float, float]:
        """The task's (start, end) on the host clock; call once it has ended on the device.
        ``issued_ms``: the host time at which the task was issued (its start is no earlier)."""
        with self._lock:
            observed = self._now()  # under the lock: observations arrive in increasing order
            if not self._ends or end_elapsed_ms > self._ends[-1]:
                self._ends.append(end_elapsed_ms)
                self._observed.append(observed)
                self._forget(observed)
            if issued_ms is not None and self.base_ms + self._shift + start_elapsed_ms < issued_ms:
                self._shift = issued_ms - self.base_ms - start_elapsed_ms
            if self.base_ms + self._shift + end_elapsed_ms > observed:  # the end bound wins a conflict
                self._shift = observed - self.base_ms - end_elapsed_ms
            start, end = self._map(start_elapsed_ms, True, issued_ms), self._map(end_elapsed_ms, False)
            self._tasks += 1
            self._device_ms += end_elapsed_ms - start_elapsed_ms
            self._mapped_ms += end - start
            return start, end

    def statistics(self) -> DeviceClockStatistics:
        with self._lock:
            return DeviceClockStatistics(self._tasks, self._device_ms, self._mapped_ms, self._shift)

    def _map(self, elapsed_ms: float, start: bool, least: float | None = None) -> float:
        """``elapsed_ms`` (a task's start or end) on the host clock, no earlier than ``least``."""
        at = bisect.bisect_left(self._ends, elapsed_ms)
        mapped = self.base_ms + self._shift + elapsed_ms
        if at < len(self._ends):
            mapped = min(mapped, self._observed[at])
        if least is not None:
            mapped = max(mapped, least)
        # Between the times placed before and after it on the device. At one device time ends
        # come before starts (a task that starts as another ends may not be placed before it).
        key = (elapsed_ms, start)
        before = bisect.bisect_right(self._at, key)
        if before:
            mapped = max(mapped, self._placed[before - 1])
        if before < len(self._at):
            mapped = min(mapped, self._placed[before])
        self._at.insert(before, key)
        self._placed.insert(before, mapped)
        return mapped

    def _forget(self, observed: float) -> None:
        stale = bisect.bisect_left(self._observed, observed - KEEP_OBSERVED_MS)
        if stale > len(self._observed) // 2:  # in halves: amortised constant per observation
            del self._ends[:stale]
            del self._observed[:stale]
            old = bisect.bisect_left(self._placed, observed - KEEP_OBSERVED_MS)
            del self._at[:old]
            del self._placed[:old]
