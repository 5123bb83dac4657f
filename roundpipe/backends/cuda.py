"""The CUDA backend: per device a compute stream and four copy streams; the host runs ahead.

Why this shape: the engine already guarantees that a task starts only when its dependencies
allow it and its lane is free, so each lane needs exactly one thing from CUDA, a stream of its
own. A lane thread *issues* its task's work on its stream and returns at once: it never waits
for the GPU. Ordering against the task's dependencies is expressed on the device: before the
work, the stream waits on the CUDA events its device dependencies recorded when they were
issued (`stream.wait_event`; on each other lane only the one issued last, `stream_waits`), so the
engine may issue a task as soon as what it depends on is issued (the engine's ``issues_ahead``
protocol). After the work the lane records a blocking event and hands it to the lane's waiter
thread, which sleeps until the event completes (no spinning core), and only then reports the
task done. Host consumers (the optimizer lane's G-copy and P-copy, the one-stage prefetch and
one-microbatch-ahead limits, buffer reuse) wait for that completion; device consumers do not.

Each task is timed on the device itself: a timing event before and after its work gives the
task's real start and end on the GPU, on the same millisecond clock as the host, so the trace,
the bubble figures and the five-rule checker describe what the GPU did, not when the host
queued it (`Task.issue_t` keeps that).

Memory across streams: a tensor allocated on one stream and read on another must not be reused
before the reader is done. The runtime keeps such tensors alive until the reading task has
completed (`Runtime.hold` / `Runtime.finish`), so the caching allocator only recycles them
afterwards.

The lanes are threads of one interpreter, so the compute lane shares the GIL with the waiters,
the copy lanes, the optimizer lane and the engine's loop; each torch call lets go of the GIL and
takes it back, and a thread that wants it back waits until the holder drops it, by default up to
5 ms (`sys.getswitchinterval`). While a CUDA pipe is open the interval is 0.5 ms at most
(`GIL_SWITCH`, given back when the last one closes). On an H200, workload A (4,096-token
microbatches, the host issuing kernels about as fast as the GPU runs them) runs at 26,762 and
26,452 tokens/s with it against 25,443 and 21,338 without, alternated on one machine, the GPU
waiting on the host for 35-37% of the step against 42-65% (docs/performance.md, "Where A's step
goes").

It must never decide ordering and never leave a thread running after `close()`.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from roundpipe.backends.budget import require_devices
from roundpipe.backends.device_clock import DeviceClock, DeviceClockStatistics
from roundpipe.backends.held_setting import HeldSetting
from roundpipe.backends.runtime import Runtime
from roundpipe.backends.stream_waits import Issued, stream_waits
from roundpipe.backends.threads import LaneThreadBackend, Waiter
from roundpipe.sched.task import Task

# The interpreter's GIL switch interval while a CUDA pipe is open: at most this (module docstring).
GIL_SWITCH_INTERVAL_S = 0.0005
GIL_SWITCH: HeldSetting[float] = HeldSetting(
    sys.getswitchinterval, sys.setswitchinterval, lambda found: min(found, GIL_SWITCH_INTERVAL_S)
)


class CudaBackend(LaneThreadBackend):
    """Issues each lane's tasks on that lane's CUDA stream; see the module docstring."""

    issues_ahead = True
    _holds_gil_switch = False  # set once `GIL_SWITCH` is acquired (the end of __init__)

    def __init__(
        self, runtime: Runtime, device_indices: tuple[int, ...], *, host_threads: int | None = None
    ) -> None:
        require_devices(device_indices)
        super().__init__(runtime)
        self.device_indices = device_indices
        runtime.devices = {d: torch.device("cuda", index) for d, index in enumerate(device_indices)}
        runtime.defer_release = True
        self._streams: dict[str, Any] = {}
        # key of an issued, not yet completed device task -> its lane, issue order and end event
        self._events: dict[Any, Issued] = {}
        self._events_lock = threading.Lock()
        self._issued_count = 0
        # One clock for host and devices: a base event per device, recorded now, and each
        # device's times mapped onto the host clock by one monotone map (`DeviceClock`).
        self._base: dict[int, tuple[Any, DeviceClock]] = {}
        for d, index in enumerate(device_indices):
            with torch.cuda.device(index):
                base = torch.cuda.Event(enable_timing=True)
                base.record()
                base.synchronize()
                self._base[d] = (base, DeviceClock(self.now(), self.now))
        self._limit_host_threads(host_threads)
        runtime.compiler.open()
        GIL_SWITCH.acquire()
        self._holds_gil_switch = True

    def _limit_host_threads(self, host_threads: int | None) -> None:
        """Keep cores free for the lane threads that launch kernels: torch's intra-op pool (the
        CPU optimizer, the P-copy) would otherwise take every core and delay each launch."""
        if host_threads is None:
            cores = os.cpu_count() or 1
            host_threads = max(1, cores - 2 * len(self.device_indices) - 1)
        if torch.get_num_threads() > host_threads:
            torch.set_num_threads(host_threads)
        self.host_threads = torch.get_num_threads()

    def _stream(self, task: Task) -> Any:
        stream = self._streams.get(task.lane)
        if stream is None:
            stream = torch.cuda.Stream(device=self.runtime.device(task.device))
            self._streams[task.lane] = stream
        return stream

    def execute(self, task: Task) -> Waiter | None:
        if task.device < 0:  # host lane (the optimizer): plain CPU work, complete on return
            self.runtime.run(task)
            return None
        device = self.runtime.device(task.device)
        stream = self._stream(task)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            with self._events_lock:  # the last dependency issued on each other lane (stream_waits)
                waits = stream_waits(task.deps, self._events, task.lane)
            for event in waits:
                stream.wait_event(event)
            issued = self.now()  # the GPU cannot start the task before this (`DeviceClock`)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self.runtime.run(task)
            end = torch.cuda.Event(enable_timing=True, blocking=True)
            end.record(stream)
        with self._events_lock:
            self._issued_count += 1
            self._events[task.key] = Issued(task.lane, self._issued_count, end)
        return lambda: self._wait(task, start, end, issued)

    def _wait(self, task: Task, start: Any, end: Any, issued: float) -> None:
        try:
            end.synchronize()  # sleeps (blocking event), releases the GIL
            base, clock = self._base[task.device]
            task.start_t, task.end_t = clock.place(base.elapsed_time(start), base.elapsed_time(end), issued)
        finally:
            with self._events_lock:
                self._events.pop(task.key, None)

    def clock_statistics(self) -> dict[int, DeviceClockStatistics]:
        """Per device, what its map onto the host clock has done (`DeviceClock.statistics`): a
        trace whose tasks lost length in the map reads a larger bubble than the GPU had."""
        return {d: clock.statistics() for d, (_, clock) in self._base.items()}

    def close(self) -> None:
        super().close()
        self._events.clear()
        self._streams.clear()
        _release_cublas_workspaces()
        self.runtime.compiler.close()
        if self._holds_gil_switch:
            self._holds_gil_switch = False
            GIL_SWITCH.release()


def _release_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per (thread handle, stream): every lane stream this
    backend created got one (32 MiB or more on a Hopper card) from the caching allocator, and torch
    frees none of them while the process lives, so each pipe closed and replaced in one process
    would leave its workspaces allocated on the device. Called once every lane has finished; a
    stream still in use elsewhere gets a new workspace at its next matrix product."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
