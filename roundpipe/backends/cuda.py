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

from typing import Any

import torch

from roundpipe.backends.runtime import Runtime
from roundpipe.backends.threads import LaneThreadBackend
from roundpipe.errors import ConfigError
from roundpipe.sched.task import Task


class CudaBackend(LaneThreadBackend):
    """Runs each lane's tasks on that lane's CUDA stream; see the module docstring."""

    def __init__(self, runtime: Runtime, device_indices: tuple[int, ...]) -> None:
        if not torch.cuda.is_available():
            raise ConfigError('devices="cuda" but CUDA is not available; use devices="cpu:N"')
        count = torch.cuda.device_count()
        for index in device_indices:
            if not 0 <= index < count:
                raise ConfigError(f"cuda:{index} does not exist: this machine has {count} CUDA device(s)")
        super().__init__(runtime)
        self.device_indices = device_indices
        runtime.devices = {d: torch.device("cuda", index) for d, index in enumerate(device_indices)}
        self._streams: dict[str, Any] = {}

    def _stream(self, task: Task) -> Any:
        stream = self._streams.get(task.lane)
        if stream is None:
            stream = torch.cuda.Stream(device=self.runtime.device(task.device))
            self._streams[task.lane] = stream
        return stream

    def execute(self, task: Task) -> None:
        if task.device < 0:  # host lane (the optimizer): plain CPU work
            self.runtime.run(task)
            return
        stream = self._stream(task)
        with torch.cuda.device(self.runtime.device(task.device)), torch.cuda.stream(stream):
            self.runtime.run(task)
        stream.synchronize()  # blocks this lane only; the other streams keep running
