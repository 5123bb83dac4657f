"""The list schedule both stream models run (`_stream.stream_ms`, `_split_stream.split_ms`) in
Python: the reference of `_kernels.c`'s ``stream_loop``, and what runs where that is not built.

Why a module of its own: it is the one loop both models share, and it must match the compiled
loop step for step (`tests/test_native_kernels.py`), so it stays one function, written as the C
is. It runs graphs only: it must never build them, build plans, or import torch or the scheduler.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


class SplitExtras:
    """`_split_stream.split_ms`'s dependents that come from the plan rather than the graph: when
    task t ends, ``uploads[uploads_after[t]]`` (the uploads of the device's run after next, for a
    run's last task), and for a forward run q's microbatch j (``saving[t] = q * bound + j``) every
    code of ``readers[q]``, 2j on (the recomputes reading its saved activation). -1: none."""

    __slots__ = ("bound", "readers", "saving", "uploads", "uploads_after")

    def __init__(
        self,
        uploads_after: list[int],
        uploads: list[int],
        saving: list[int],
        readers: list[list[int]],
        bound: int,
    ) -> None:
        self.uploads_after, self.uploads, self.saving = uploads_after, uploads, saving
        self.readers, self.bound = readers, bound


def event_loop(
    duration: Sequence[float],
    device: Sequence[int],
    after: Sequence[Sequence[int]],
    unmet: list[int],
    ready: list[list[int]],
    left: list[float] | None = None,
    give_up: float = math.inf,
    watched: tuple[int, ...] = (),
    span: float = math.inf,
    split: SplitExtras | None = None,
) -> tuple[float, list[float]]:
    """The list schedule of both stream models (`_list_schedule`, `_split_stream.split_ms`; the
    reference of `_kernels.c`'s ``stream_loop``), on a graph's ``unmet`` and per device ``ready``
    heaps (both used up): a free device starts its ready task first in task order; computes end
    in time order; a dependent numbered past the task count (``hops * count + task``) is met once
    every compute ending at that instant has, by that number. Returns when the last task ends and
    every start (-1: not started); early (inf) once device d, starting a task at ``now`` with
    ``left[d]`` to do, shows the makespan past ``give_up``, or once ``watched`` all started (early,
    inf, once a compute ends ``span`` after the first of them started while another has not: it
    can start no earlier than that). ``split``: the split model's dependents from the plan."""
    k = len(duration)
    num_devices = len(ready)
    left = list(left or [0.0] * num_devices)
    watch, waiting = _flags(k, watched), len(set(watched)) or -1
    opening, deadline = (watched[0] if watched else -1), math.inf
    busy, start = [False] * num_devices, [-1.0] * k
    ends: list[tuple[float, int]] = []  # computes that end: (time, task)
    met: list[int] = []  # dependencies met after the transfers in between, by (hops, task)
    heappush, heappop = heapq.heappush, heapq.heappop
    now, touched = 0.0, list(range(num_devices))
    while True:
        for d in touched:
            if not busy[d] and ready[d]:
                t = heappop(ready[d])
                busy[d] = True
                start[t] = now
                heappush(ends, (now + duration[t], t))
                if now + left[d] > give_up:
                    return math.inf, start
                left[d] -= duration[t]
                if watch[t]:
                    waiting -= 1
                    if not waiting:
                        return now, start
                    if t == opening:
                        deadline = now + span
        touched = []
        if ends and (ends[0][0] == now or not met):
            now, t = heappop(ends)
            if now > deadline:
                return math.inf, start
        elif met:
            t = heappop(met) % k
            unmet[t] -= 1
            if not unmet[t]:
                heappush(ready[device[t]], t)
                touched.append(device[t])
            continue
        else:
            break
        busy[device[t]] = False
        touched.append(device[t])
        for u in after[t]:
            if u >= k:  # met after transfers
                heappush(met, u)
            else:
                unmet[u] -= 1
                if not unmet[u]:
                    heappush(ready[device[u]], u)
                    touched.append(device[u])
        if split is not None:
            if split.uploads_after[t] >= 0:
                heappush(met, split.uploads[split.uploads_after[t]])
            if split.saving[t] >= 0:
                q, j = divmod(split.saving[t], split.bound)
                for code in split.readers[q]:
                    heappush(met, code + 2 * j)
    return now, start


def _flags(count: int, tasks: tuple[int, ...]) -> bytearray:
    flags = bytearray(count)
    for t in tasks:
        flags[t] = 1
    return flags
