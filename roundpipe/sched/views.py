"""What every view of a trace shares: lane order, short task names, safe file writes.

Why a module of its own: the Perfetto file, the PNG timeline and the ASCII grid
(`roundpipe.sched.export`, `roundpipe.sched.grid`) must order lanes and name tasks the same way,
so that what a terminal shows matches what a report shows. It only reads tasks and must never
import torch or an optional package.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE_KINDS,
    DEVICE_LANES,
    G_COPY,
    GRAD_NORM,
    GRAD_UP,
    P_COPY,
    RECOMPUTE,
    STEP,
    Task,
)

if TYPE_CHECKING:
    from roundpipe.sched.trace import Trace

HOST_DEVICE = -1
_HOST_LANE_ORDER = ("optimizer",)


# --------------------------------------------------------------------- shared helpers


def lane_suffix(lane: str) -> str:
    """``"d3.act_up"`` -> ``"act_up"``; ``"host.optimizer"`` -> ``"optimizer"``."""
    return lane.split(".", 1)[1] if "." in lane else lane


def lane_rank(lane: str) -> tuple[int, str]:
    suffix = lane_suffix(lane)
    order = DEVICE_LANES + _HOST_LANE_ORDER
    return (order.index(suffix), suffix) if suffix in order else (len(order), suffix)


def device_rank(device: int) -> tuple[int, int]:
    """Devices in numeric order, the host last."""
    return (1, 0) if device < 0 else (0, device)


def lane_rows(trace: Trace, lanes: Iterable[str] | None = None) -> list[tuple[int, str]]:
    """The (device, lane) pairs of ``trace`` in display order: devices in order, the host last,
    and within a device the lanes ordered compute, act_up, act_down, param_up, grad_down.

    ``lanes`` keeps only the lanes whose short name (``"compute"``) is listed.
    """
    keep = None if lanes is None else set(lanes)
    pairs = {(t.device, t.lane) for t in trace.records}
    if keep is not None:
        pairs = {(d, lane) for d, lane in pairs if lane_suffix(lane) in keep}
    return sorted(pairs, key=lambda p: (device_rank(p[0]), lane_rank(p[1]), p[1]))


def _layers_text(layers: range) -> str:
    if not len(layers):
        return ""
    first, last = layers.start, layers.stop - 1
    return f"L{first}" if first == last else f"L{first}-{last}"


def task_label(task: Task) -> str:
    """A short name for a task, as shown on a timeline.

    Compute tasks are named by stage and microbatch (``"F1 mb3"``); others by kind, stage and
    layers (``"param_up F1 L4"``), plus the microbatch for activation transfers and the step for
    optimizer-lane work.
    """
    if task.kind in COMPUTE_KINDS:
        bits = [task.stage or "compute"]
        if task.kind == RECOMPUTE:
            bits.append("recompute")
        if task.microbatch >= 0:
            bits.append(f"mb{task.microbatch}")
        return " ".join(bits)
    bits = [task.kind]
    if task.stage:
        bits.append(task.stage)
    layers = _layers_text(task.layers)
    if layers:
        bits.append(layers)
    if task.num_parts > 1:
        bits.append(f"p{task.part + 1}/{task.num_parts}")
    if task.microbatch >= 0 and task.kind in (ACT_UP, GRAD_UP, ACT_DOWN):
        bits.append(f"mb{task.microbatch}")
    if task.step >= 0 and task.kind in (STEP, P_COPY, G_COPY, GRAD_NORM):
        bits.append(f"s{task.step}")
    return " ".join(bits)


def json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def atomic_write(path: Path, write: Any, mode: str = "w") -> Path:
    """Write through a temp file in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        # mkstemp makes the file private (0600); give it the mode an ordinary open() would.
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def finished_tasks(trace: Trace) -> list[Task]:
    """Tasks with real start/end times (a trace of a failed run can hold unstarted ones)."""
    return [t for t in trace.records if t.start_t >= 0 and t.end_t >= t.start_t]
