"""The CPU backend: N worker "devices" made of threads, doing real torch math.

Why it exists: CI has no GPU, yet the whole training path (transient copies, boundary
activations on the host, recompute, gradient downloads, the optimizer lane) must run and be
compared against plain PyTorch. Each device gets one thread per lane (compute, act_up, act_down,
param_up, grad_down) and the host one optimizer thread, so lanes overlap exactly as CUDA streams
would; the math itself is the shared `Runtime`. Completions return to the engine's loop through
a `CompletionPipe`.

It must never decide ordering (the engine does) and never leave a thread running after
`close()`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from roundpipe.backends.runtime import Runtime
from roundpipe.sched.backend import CompletionPipe, DoneCallback
from roundpipe.sched.task import Task


class CpuBackend:
    """Runs tasks on per-lane worker threads; see the module docstring."""

    virtual = False

    def __init__(self, runtime: Runtime, num_devices: int) -> None:
        self.runtime = runtime
        self.num_devices = num_devices
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._pipe: CompletionPipe | None = None
        self._t0 = time.perf_counter()
        self._closed = False

    def bind(self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None:
            raise RuntimeError("the CPU backend needs a running event loop")
        self._pipe = CompletionPipe(loop, done)

    def resource(self, lane: str) -> str:
        return lane

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def advance(self) -> bool:
        return False

    def next_time(self) -> float | None:
        return None

    def _executor(self, lane: str) -> ThreadPoolExecutor:
        executor = self._executors.get(lane)
        if executor is None:
            if self._closed:
                raise RuntimeError("the CPU backend is closed")
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
            self.runtime.run(task)
        except BaseException as exc:  # reported to the engine, which re-raises in the caller
            error = exc
        assert self._pipe is not None
        self._pipe.put(task, error)

    def close(self) -> None:
        self._closed = True
        executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
