"""A fake backend that issues device work ahead of completion, as CUDA streams do.

Why it exists: the CUDA backend's protocol (a task is *issued* when its work is queued on its
lane's stream behind device-side waits on its dependencies, and *done* when that work has run)
is where ordering bugs would hide, and CI has no GPU. This backend follows the same protocol on
the virtual clock, exactly: each lane is a stream that runs its issued work in issue order; a
device task's work starts when it has been issued, the previous work of its stream (or of the
link its stream shares) has ended, and every device dependency has ended (waiting, as the CUDA
backend does, on the last one issued on each other lane: `stream_waits`); host work (the
optimizer lane) runs when started and completes after its duration, as on `FakeBackend`. The
engine therefore sees what it sees on a GPU: issue reports at once, completions later, and the
trace holds device start and end times (`Task.issue_t` is when the host queued the work).

``issue_ms`` charges the host for issuing (the Python and launch cost of a task): the lane is
busy for that long before its work is queued, which is what running ahead hides. A number is
every device task's cost; a function of the task gives each its own (on a GPU, a compute task's
issuing grows with its layers while an upload piece's is a call).

It must never import torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from roundpipe.backends.fake import FakeBackend
from roundpipe.backends.stream_waits import Issued, stream_waits
from roundpipe.sched.backend import DoneCallback, IssuedCallback
from roundpipe.sched.task import Task

_ISSUE, _DONE = 0, 1  # at one instant, issue reports go before completions


class FakeStreamBackend(FakeBackend):
    """`FakeBackend` with CUDA-stream semantics for device lanes; see the module docstring."""

    issues_ahead = True

    def __init__(self, *args: Any, issue_ms: float | Callable[[Task], float] = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.issue_ms = issue_ms
        self._issued_cb: IssuedCallback | None = None
        self._stream_end: dict[str, float] = {}  # stream (or shared link) -> end of its issued work
        self._ends: dict[Any, Issued] = {}  # issued, not yet done device task -> its end
        self._events: list[tuple[float, int, int, Task]] = []

    def bind(self, done: DoneCallback, loop: Any, issued: IssuedCallback | None = None) -> None:
        super().bind(done, loop)
        self._issued_cb = issued

    def start(self, task: Task) -> None:
        self._counter += 1
        ms = self.duration(task)
        now = self._clock
        if task.device < 0:  # host work: runs now, on the host
            heapq.heappush(self._events, (now + ms, _DONE, self._counter, task))
            return
        issued_at = now + (self.issue_ms(task) if callable(self.issue_ms) else self.issue_ms)
        stream = self.resource(task.lane)
        begin = max(issued_at, self._stream_end.get(stream, 0.0))
        for end in stream_waits(task.deps, self._ends, task.lane):  # as the CUDA backend waits
            begin = max(begin, end)
        end = begin + ms
        self._stream_end[stream] = end
        self._ends[task.key] = Issued(task.lane, self._counter, end)
        task.start_t = begin
        task.end_t = end
        heapq.heappush(self._events, (issued_at, _ISSUE, self._counter, task))
        heapq.heappush(self._events, (end, _DONE, self._counter, task))

    def advance(self) -> bool:
        if not self._events:
            return False
        when, what, _, task = heapq.heappop(self._events)
        self._clock = when
        if what == _ISSUE:
            assert self._issued_cb is not None, "bind() the engine's issued callback first"
            self._issued_cb(task)
            return True
        self._ends.pop(task.key, None)
        error = self._fail(task) if self._fail is not None else None
        if error is None and self._execute is not None:
            try:
                self._execute(task)
            except Exception as exc:
                error = exc
        assert self._done is not None
        self._done(task, error)
        return True

    def next_time(self) -> float | None:
        return self._events[0][0] if self._events else None

    def close(self) -> None:
        self._events.clear()
        super().close()
