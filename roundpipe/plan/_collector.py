"""The garbage collector paused while the planner runs.

Why: planning allocates tens of thousands of small, short-lived, acyclic objects (candidate
plans, stage tuples, replay graphs as lists), which reference counting frees. Their allocations
still advance the collector's counters, and a full collection that lands inside planning walks
every object of the process: in a benchmark process holding 200K objects one costs about 120 ms,
against 25-50 ms of planning at 94 layers, and in a training process (a model, transformers, the
data pipeline) it is more. Pausing defers that walk to whatever allocates next, where it belongs
to the process, not to the plan."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collections_paused() -> Iterator[None]:
    """The collector off inside the block (nested blocks leave it as the outer one found it)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()
