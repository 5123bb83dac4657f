"""How fast this host issues work: its CPU, and two short timings taken before a GPU run.

Why: a mixture of experts issues thousands of small kernels an iteration, so its host-bound share
is a property of the host as much as of roundpipe. The same D workload on three H100 machines ran
host-bound 9.9%, 5.4% and 56-88% (docs/performance.md), the last on a host that also built the
model 1.5x slower. A line that carries these figures says which host it ran on, so two lines from
different machines are compared for what they are.

Both timings are the best of a few repeats (the least disturbed), in the benchmark's own process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first "model name" of ``cpuinfo``; None where the file or the field is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def _best_ms(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def host_probe(repeats: int = 5, calls: int = 2000) -> dict[str, Any]:
    """The CPU model, its logical cores, a pure-Python loop's milliseconds (interpreter speed) and
    the microseconds of one eager ``torch.add`` on one-element CPU tensors (operator dispatch, the
    host cost each launched kernel pays before it reaches the device)."""
    a, b = torch.ones(1), torch.ones(1)

    def dispatch() -> None:
        for _ in range(calls):
            torch.add(a, b)

    dispatch()  # the first calls pay for lazy initialisation
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python_loop_ms": round(_best_ms(lambda: sum(i * i for i in range(200_000)), repeats), 2),
        "torch_op_us": round(_best_ms(dispatch, repeats) * 1e3 / calls, 2),
    }
