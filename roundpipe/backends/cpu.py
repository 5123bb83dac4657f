"""The CPU backend: N worker "devices" made of threads, doing real torch math.

Why it exists: CI has no GPU, yet the whole training path (transient copies, boundary
activations on the host, recompute, gradient downloads, the optimizer lane) must run and be
compared against plain PyTorch. Each device gets one thread per lane (compute, act_up, act_down,
param_up, grad_down) and the host one optimizer thread, so lanes overlap exactly as CUDA streams
would; the math itself is the shared `Runtime`, and the threads are `LaneThreadBackend`'s.

It must never decide ordering (the engine does) and never leave a thread running after
`close()`.

Intra-op threads: torch runs a CPU op's parallel parts on an OpenMP team of the calling thread,
`torch.get_num_threads()` threads by default, every thread its own team. N workers' compute lanes
computing at once so ran N times as many threads as the process was given (two workers on two
cores: four), and with more threads in teams than cores OpenMP stops spinning between parallel
regions, so every small op in the process, the caller's own too, pays to wake its team. Each
compute lane therefore takes its share, ``torch.get_num_threads() // N`` (at least one), as it
starts; one worker keeps them all. `roundpipe train`'s default run (two workers, two cores) trains
at 3,722-3,759 tok/s so against 3,198-3,242 with every lane at the process's count (two runs each,
alternated), with the same losses.
"""

from __future__ import annotations

import threading

import torch

from roundpipe.backends.runtime import Runtime
from roundpipe.backends.threads import LaneThreadBackend
from roundpipe.sched.views import lane_suffix


class CpuBackend(LaneThreadBackend):
    """Runs tasks on per-lane worker threads (started as each lane is first used, so the
    device count is the plan's, not the backend's); see the module docstring. ``num_devices``:
    the workers the run was given, among which the compute lanes share the intra-op threads."""

    def __init__(self, runtime: Runtime, num_devices: int = 1) -> None:
        super().__init__(runtime)
        self.process_threads = torch.get_num_threads()
        self.compute_threads = max(1, self.process_threads // max(1, num_devices))

    def lane_started(self, lane: str) -> None:
        share = self.compute_threads if lane_suffix(lane) == "compute" else None
        use_intra_op_threads(share if share != self.process_threads else None, self.process_threads)


_COUNT_LOCK = threading.Lock()
"""Held while a lane thread takes its intra-op thread count: torch's process-wide count, which a
thread reads into its own at its first parallel op, is another number for a moment while a compute
lane sets its own (`use_intra_op_threads`), and no lane may read it then."""


def use_intra_op_threads(count: int | None, process_default: int) -> None:
    """The calling thread's intra-op threads read from the process count now (None), or set to
    ``count`` with the process count left at ``process_default`` for threads started later. torch
    keeps one process-wide count, which a thread reads into its own on its first parallel op
    (`torch.get_num_threads` triggers that read, so it is done first, under `_COUNT_LOCK`) and which
    `torch.set_num_threads` also writes: a short thread writes the default back."""
    with _COUNT_LOCK:
        torch.get_num_threads()
        if count is None:
            return
        torch.set_num_threads(count)
        restore = threading.Thread(
            target=torch.set_num_threads, args=(process_default,), name="roundpipe-threads"
        )
        restore.start()
        restore.join()
