"""What the engine needs from a backend, and the one piece of plumbing real backends share.

The engine decides *when* a task runs; a backend decides *how*. Keeping the contract this small
is what lets the same engine drive a virtual clock (the fake backend), CPU worker threads and
CUDA streams. Nothing here may import torch or know about partitioning.

Two families:
- virtual backends (``virtual = True``) keep their own clock; the engine calls ``advance()`` to
  finish the earliest running task(s), synchronously, and never sleeps;
- real backends run tasks on their own threads and report each completion to the loop thread
  through a `CompletionPipe`, which batches completions that arrive together into one
  ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from roundpipe.sched.task import Task

DoneCallback = Callable[["Task", "BaseException | None"], None]
IssuedCallback = Callable[["Task"], None]


class Backend(Protocol):
    """The contract between the engine and whatever runs the tasks."""

    virtual: bool
    """True when the backend owns a virtual clock and completes tasks only inside `advance()`."""

    issues_ahead: bool
    """True when device work is *issued* before it completes (CUDA streams): the backend then
    reports each device task twice, ``issued(task)`` when its work is queued on the device and
    ``done(task, error)`` when it has run. A device task whose dependencies on the same device are
    issued may be issued too (the backend orders it after them on the device); host work,
    dependencies on another device and those a task lists in ``sync_deps`` wait for completion."""

    def bind(
        self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None, issued: IssuedCallback | None = None
    ) -> None:
        """Called once by the engine: ``done(task, error)`` and ``issued(task)`` must be called on
        the loop thread."""

    def resource(self, lane: str) -> str:
        """The resource a lane runs on; lanes that share a resource run one task at a time."""

    def now(self) -> float:
        """Current time in milliseconds (virtual or wall clock)."""

    def start(self, task: Task) -> None:
        """Begin running ``task``; report its completion later through the bound callback."""

    def advance(self) -> bool:
        """Virtual backends: complete the next task(s); False when nothing is running."""

    def next_time(self) -> float | None:
        """Virtual backends: when the earliest running task ends (None when nothing runs)."""

    def close(self) -> None:
        """Release threads and memory. Idempotent."""


_ISSUED = object()  # marks an "issued" item in the pipe (a completion carries an error or None)


class CompletionPipe:
    """Carries issue and completion reports from worker threads to the event loop, batched.

    Workers call `put(task, error)` (completion) or `put_issued(task)` from any thread, in the
    order they happen. The first report after the loop has drained schedules one drain callback;
    reports that arrive before it runs ride along, and are delivered in arrival order.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, done: DoneCallback, issued: IssuedCallback | None = None
    ) -> None:
        self._loop = loop
        self._done = done
        self._issued = issued
        self._lock = threading.Lock()
        self._items: list[tuple[Task, object]] = []
        self._scheduled = False

    def put_issued(self, task: Task) -> None:
        self._put(task, _ISSUED)

    def put(self, task: Task, error: BaseException | None = None) -> None:
        self._put(task, error)

    def _put(self, task: Task, what: object) -> None:
        with self._lock:
            self._items.append((task, what))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the pipe is shutting down, nobody is waiting
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for task, what in items:
            if what is _ISSUED:
                if self._issued is not None:
                    self._issued(task)
            else:
                self._done(task, what)  # type: ignore[arg-type]
