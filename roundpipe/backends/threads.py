"""Lane threads: the part every real backend shares.

A real backend runs each lane's tasks on a thread of that lane (so lanes overlap exactly as the
engine allows and never more), reports each task to the engine's loop through a
`CompletionPipe`, keeps a wall clock, and on `close()` stops every thread it started. What a
task does on its thread is the one thing a subclass says, in `execute`:

- work that is finished when `execute` returns (CPU math, the host optimizer lane) returns None,
  and the task is reported done at once;
- work that was only *issued* (kernels and copies queued on a CUDA stream) returns a waiter: the
  task is reported issued at once, so the engine can issue what depends on it, and the lane's
  waiter thread blocks on the waiter, off the lane and off the loop, then reports it done.

A lane's waiter thread sees its tasks in issue order, which is the order they complete in on
the lane's stream, so completions are never reported out of order within a lane.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from roundpipe.backends.runtime import Runtime
from roundpipe.sched.backend import CompletionPipe, DoneCallback, IssuedCallback
from roundpipe.sched.task import Task

Waiter = Callable[[], None]
"""Blocks until a task's issued work has completed; raises what went wrong on the device."""


class LaneThreadBackend:
    """Base of the CPU and CUDA backends: one worker thread per lane, completions batched to
    the loop, no thread left after `close()`."""

    virtual = False
    issues_ahead = False

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._waiters: dict[str, tuple[queue.SimpleQueue[tuple[Task, Waiter] | None], threading.Thread]] = {}
        self._pipe: CompletionPipe | None = None
        self._t0 = time.perf_counter()
        self._closed = False

    def bind(
        self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None, issued: IssuedCallback | None = None
    ) -> None:
        if loop is None:
            raise RuntimeError(f"{type(self).__name__} needs a running event loop")
        self._pipe = CompletionPipe(loop, done, issued)

    def resource(self, lane: str) -> str:
        return lane

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def advance(self) -> bool:
        return False

    def next_time(self) -> float | None:
        return None

    def lane_started(self, lane: str) -> None:
        """Runs first on ``lane``'s thread, before any of its tasks (per-thread settings)."""

    def execute(self, task: Task) -> Waiter | None:
        """Do (or issue) the task's work on its lane thread. None: the work is complete; a waiter:
        the work is issued, and the waiter blocks until it has run."""
        self.runtime.run(task)
        return None

    def _executor(self, lane: str) -> ThreadPoolExecutor:
        executor = self._executors.get(lane)
        if executor is None:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"roundpipe-{lane}",
                initializer=self.lane_started,
                initargs=(lane,),
            )
            self._executors[lane] = executor
        return executor

    def start(self, task: Task) -> None:
        try:
            self._executor(task.lane).submit(self._run, task)
        except RuntimeError as exc:  # closed, or the interpreter is exiting: report, never hang
            assert self._pipe is not None
            self._pipe.put(task, exc)

    def _run(self, task: Task) -> None:
        assert self._pipe is not None
        try:
            waiter = self.execute(task)
        except BaseException as exc:  # reported to the engine, which re-raises in the caller
            self._complete(task, exc)
            return
        if waiter is None:
            self._complete(task, None)
            return
        # When the host finished issuing, on the lane (the loop may see it later): a device task
        # whose work on the GPU ends soon after this was waiting for the host, not the host for it.
        task.issue_t = self.now()
        self._pipe.put_issued(task)
        self._waiter_queue(task.lane).put((task, waiter))

    def _complete(self, task: Task, error: BaseException | None) -> None:
        """Release what the task's work held on to (its inputs may be reused now), then report."""
        try:
            self.runtime.finish(task, failed=error is not None)
        except BaseException as exc:
            error = error or exc
        assert self._pipe is not None
        self._pipe.put(task, error)

    # ------------------------------------------------------------------ waiter threads

    def _waiter_queue(self, lane: str) -> queue.SimpleQueue[tuple[Task, Waiter] | None]:
        entry = self._waiters.get(lane)
        if entry is None:
            inbox: queue.SimpleQueue[tuple[Task, Waiter] | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._wait_loop, args=(inbox,), name=f"roundpipe-{lane}-waiter", daemon=True
            )
            thread.start()
            entry = self._waiters[lane] = (inbox, thread)
        return entry[0]

    def _wait_loop(self, inbox: queue.SimpleQueue[tuple[Task, Waiter] | None]) -> None:
        while True:
            item = inbox.get()
            if item is None:
                return
            task, waiter = item
            error: BaseException | None = None
            try:
                waiter()
            except BaseException as exc:
                error = exc
            self._complete(task, error)

    def close(self) -> None:
        self._closed = True
        executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
        waiters, self._waiters = self._waiters, {}
        for inbox, _ in waiters.values():
            inbox.put(None)  # after every issued task: each is still reported
        for _, thread in waiters.values():
            thread.join()
