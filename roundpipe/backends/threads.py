"""Lane threads: the part every real backend shares.

A real backend runs each lane's tasks on a thread of that lane (so lanes overlap exactly as the
engine allows and never more), reports each completion to the engine's loop through a
`CompletionPipe`, keeps a wall clock, and on `close()` stops every thread it started. What a
task does on its thread (plain CPU math, or math issued on a CUDA stream) is the one thing a
subclass says, in `execute`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from roundpipe.backends.runtime import Runtime
from roundpipe.sched.backend import CompletionPipe, DoneCallback
from roundpipe.sched.task import Task


class LaneThreadBackend:
    """Base of the CPU and CUDA backends: one worker thread per lane, completions batched to
    the loop, no thread left after `close()`."""

    virtual = False

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._pipe: CompletionPipe | None = None
        self._t0 = time.perf_counter()
        self._closed = False

    def bind(self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None:
            raise RuntimeError(f"{type(self).__name__} needs a running event loop")
        self._pipe = CompletionPipe(loop, done)

    def resource(self, lane: str) -> str:
        return lane

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def advance(self) -> bool:
        return False

    def next_time(self) -> float | None:
        return None

    def execute(self, task: Task) -> None:
        """Do the task's work on its lane thread; return when it is complete."""
        self.runtime.run(task)

    def _executor(self, lane: str) -> ThreadPoolExecutor:
        executor = self._executors.get(lane)
        if executor is None:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"roundpipe-{lane}")
            self._executors[lane] = executor
        return executor

    def start(self, task: Task) -> None:
        try:
            self._executor(task.lane).submit(self._run, task)
        except RuntimeError as exc:  # closed, or the interpreter is exiting: report, never hang
            assert self._pipe is not None
            self._pipe.put(task, exc)

    def _run(self, task: Task) -> None:
        error: BaseException | None = None
        try:
            self.execute(task)
        except BaseException as exc:  # reported to the engine, which re-raises in the caller
            error = exc
        assert self._pipe is not None
        self._pipe.put(task, error)

    def close(self) -> None:
        self._closed = True
        executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
