"""Allocated bytes and elapsed time around one phase of a layer's measurement.

Why a module of its own: the profile (`roundpipe.backends.profile`) measures several phases of
each layer (forward without and with grad, backward) the same way, and what "around a phase"
means on CUDA (synchronise, reset the peak, read the allocator) is worth one place of its own.
It must never allocate on the device itself nor hold a tensor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Meter:
    """Allocated bytes and elapsed time around a phase; CUDA-only numbers are 0 elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else 0

    @contextmanager
    def phase(self) -> Iterator[dict[str, float]]:
        result: dict[str, float] = {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        result["before"] = self.allocated()
        started = time.perf_counter()
        yield result
        if self.cuda:
            torch.cuda.synchronize(self.device)
        result["ms"] = (time.perf_counter() - started) * 1e3
        result["after"] = self.allocated()
        result["peak"] = float(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0.0
