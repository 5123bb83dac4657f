"""Which of a device task's dependencies its stream waits on: the last one issued on each other lane.

Why: a lane is a stream, and a stream runs its work in issue order, so an event recorded on it
completes only after everything issued on it before. Of a task's dependencies on one lane, the one
issued last covers the rest; one on the task's own lane needs no wait at all. The count matters
on CUDA: each wait is a call that lets go of the GIL and takes it back (`torch.cuda.Event.wait`),
and taking it back waits for whichever other lane thread holds it. A compute task depends on
every upload piece of its stage's weights: a Qwen3-30B-A3B layer is 19 pieces of 64 MiB (5 of
the default 256 MiB), so a two-layer stage's task waited about 40 times where one wait on the
parameter lane, one on the activation lane, suffice.

The fake stream backend chooses through the same function, so the CI tests that check its
ordering check this choice too. It must never import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from roundpipe.sched.task import Key


@dataclass(frozen=True)
class Issued:
    """What a backend keeps of an issued, not yet completed device task: its ``lane``, its place
    in the backend's issue order (``order``, increasing across all lanes) and ``handle``, what a
    dependent waits on (a CUDA event; on the fake backend, the end time)."""

    lane: str
    order: int
    handle: Any


def stream_waits(deps: Iterable[Key], issued: Mapping[Key, Issued], lane: str) -> list[Any]:
    """The handles a task on ``lane`` must wait on for ``deps``: per other lane, the handle of the
    dependency issued last there. Dependencies not in ``issued`` (completed, or host work that the
    engine waited for) need no wait."""
    last: dict[str, Issued] = {}
    for key in deps:
        entry = issued.get(key)
        if entry is None or entry.lane == lane:
            continue
        seen = last.get(entry.lane)
        if seen is None or entry.order > seen.order:
            last[entry.lane] = entry
    return [entry.handle for entry in last.values()]
