"""The CUDA backend: per device a compute stream and four copy streams, driven by lane threads.

Why this shape: the engine already guarantees that a task starts only when its dependencies are
done and its lane is free, so each lane needs exactly one thing from CUDA, a stream of its own.
A lane thread issues its task's work on its stream, waits for that stream (blocking only this
lane: the other streams of the device keep running, and the event loop never waits), and reports
completion through the `CompletionPipe`. Copies therefore overlap compute the way the design asks
(activation up/down, parameter up, gradient down, each on its own stream), the compute copy on the
host is pinned so uploads are asynchronous DMA, and the math is the same `Runtime` as on the CPU.

Memory: a device holds at most the stage it runs and one prefetched stage (the graph's prefetch
dependency), plus the activations of two microbatches; everything else stays on the host.

It must never decide ordering and never leave a thread running after `close()`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from roundpipe.backends.runtime import Runtime
from roundpipe.errors import ConfigError
from roundpipe.sched.backend import CompletionPipe, DoneCallback
from roundpipe.sched.task import Task


class CudaBackend:
    """Runs each lane's tasks on that lane's CUDA stream; see the module docstring."""

    virtual = False

    def __init__(self, runtime: Runtime, device_indices: tuple[int, ...]) -> None:
        if not torch.cuda.is_available():
            raise ConfigError('devices="cuda" but CUDA is not available; use devices="cpu:N"')
        count = torch.cuda.device_count()
        for index in device_indices:
            if not 0 <= index < count:
                raise ConfigError(f"cuda:{index} does not exist: this machine has {count} CUDA device(s)")
        self.runtime = runtime
        self.device_indices = device_indices
        runtime.devices = {d: torch.device("cuda", index) for d, index in enumerate(device_indices)}
        self._streams: dict[str, Any] = {}
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self._pipe: CompletionPipe | None = None
        self._t0 = time.perf_counter()
        self._closed = False

    def bind(self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None:
            raise RuntimeError("the CUDA backend needs a running event loop")
        self._pipe = CompletionPipe(loop, done)

    def resource(self, lane: str) -> str:
        return lane

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def advance(self) -> bool:
        return False

    def next_time(self) -> float | None:
        return None

    def _stream(self, task: Task) -> Any:
        stream = self._streams.get(task.lane)
        if stream is None:
            device = self.runtime.device(task.device)
            stream = torch.cuda.Stream(device=device)
            self._streams[task.lane] = stream
        return stream

    def _executor(self, lane: str) -> ThreadPoolExecutor:
        executor = self._executors.get(lane)
        if executor is None:
            if self._closed:
                raise RuntimeError("the CUDA backend is closed")
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
            if task.device < 0:  # host lane (the optimizer): plain CPU work
                self.runtime.run(task)
            else:
                device = self.runtime.device(task.device)
                stream = self._stream(task)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    self.runtime.run(task)
                stream.synchronize()
        except BaseException as exc:  # reported to the engine, which re-raises in the caller
            error = exc
        assert self._pipe is not None
        self._pipe.put(task, error)

    def close(self) -> None:
        self._closed = True
        executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
