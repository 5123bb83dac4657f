"""Views of a trace for people: Perfetto/Chrome JSON, a PNG timeline and an ASCII grid.

Why a separate module: a `Trace` is data and must stay importable without optional packages;
everything that only serves a human looking at a schedule lives here. The Perfetto file opens in
ui.perfetto.dev (one process per device, one track per lane), the PNG goes into reports and issues,
and the ASCII grid (`roundpipe.sched.grid`, re-exported here) is what a terminal shows when a
rule check fails, with the offending task marked. This module only reads a trace: it must never change a task, never import torch, and
import matplotlib only inside `write_png`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    COMPUTE_KINDS,
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    GRAD_UP,
    P_COPY,
    PARAM_UP,
    RECOMPUTE,
    STEP,
    Task,
)

if TYPE_CHECKING:
    from roundpipe.sched.trace import Trace
from roundpipe.sched.grid import explain_violation, format_grid
from roundpipe.sched.views import (
    atomic_write,
    device_rank,
    finished_tasks,
    json_safe,
    lane_rows,
    lane_suffix,
    task_label,
)

__all__ = [
    "explain_violation",
    "format_grid",
    "lane_rows",
    "task_label",
    "write_perfetto",
    "write_png",
]

# Kind colours (colour-blind friendly-ish, Okabe-Ito based); compute is shaded by stage kind.
_KIND_COLOURS: dict[str, str] = {
    ACT_UP: "#E69F00",
    GRAD_UP: "#B07800",
    ACT_DOWN: "#D55E00",
    PARAM_UP: "#009E73",
    GRAD_DOWN: "#CC79A7",
    G_COPY: "#56B4E9",
    GRAD_NORM: "#999999",
    STEP: "#0072B2",
    P_COPY: "#F0E442",
}
_STAGE_KIND_COLOURS: dict[str, str] = {
    SlotKind.FWD: "#9ecae1",
    SlotKind.FUSED: "#4292c6",
    SlotKind.BWD: "#08306b",
    "": "#6baed6",
}
_STAGE_KIND_NAMES = {
    SlotKind.FWD: "compute: forward",
    SlotKind.FUSED: "compute: fused",
    SlotKind.BWD: "compute: backward",
}
_RECOMPUTE_COLOUR = "#3f6fa8"  # a backward stage's recompute: between forward and backward
_OTHER_COLOUR = "#444444"


# --------------------------------------------------------------------- Perfetto


def write_perfetto(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

    One process per device (``"device 0"``, ...; ``"host"`` for device -1, listed last), one
    thread per lane, lanes ordered compute, act_up, act_down, param_up, grad_down. Each task is a
    complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds, ``cat`` its kind and ``args``
    its key, iteration, microbatch, layers, stage and step. The file is written atomically.
    """
    rows = lane_rows(trace)
    devices = sorted({d for d, _ in rows}, key=device_rank)
    num_devices = max((d for d in devices if d >= 0), default=-1) + 1
    pid_of = {d: (num_devices + 1 if d < 0 else d + 1) for d in devices}
    tid_of: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for sort_index, device in enumerate(devices):
        pid = pid_of[device]
        name = "host" if device < 0 else f"device {device}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": sort_index},
            }
        )
    per_device_count: dict[int, int] = {}
    for device, lane in rows:
        tid = per_device_count.get(device, 0) + 1
        per_device_count[device] = tid
        tid_of[(device, lane)] = tid
        pid = pid_of[device]
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane_suffix(lane)}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    for task in sorted(finished_tasks(trace), key=lambda t: (t.start_t, t.seq)):
        events.append(_task_event(task, pid_of[task.device], tid_of[(task.device, task.lane)]))
    report = trace.bubble_ratio()
    other = {
        "generator": "roundpipe",
        "tasks": len(trace),
        "bubble_ratio": report.overall,
        "makespan_ms": report.makespan_ms,
    }
    for key in ("num_devices", "async_optimizer"):
        if key in trace.meta:
            other[key] = json_safe(trace.meta[key])
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    return atomic_write(Path(path), lambda f: json.dump(document, f, separators=(",", ":")))


def _task_event(task: Task, pid: int, tid: int) -> dict[str, Any]:
    """One task as a complete event (``ph: "X"``), times in microseconds."""
    args: dict[str, Any] = {
        "key": json_safe(task.key),
        "lane": task.lane,
        "iteration": task.iteration,
        "microbatch": task.microbatch,
        "layers": [task.layers.start, task.layers.stop - 1] if len(task.layers) else [],
    }
    if task.stage:
        args["stage"] = task.stage
        args["stage_kind"] = task.stage_kind
    if task.step >= 0:
        args["step"] = task.step
    if task.nbytes:
        args["bytes"] = task.nbytes
    if task.ready_t >= 0:
        args["waited_ms"] = round(max(0.0, task.start_t - task.ready_t), 6)
    return {
        "ph": "X",
        "name": task_label(task),
        "cat": task.kind,
        "pid": pid,
        "tid": tid,
        "ts": round(task.start_t * 1000.0, 3),
        "dur": round(max(0.0, task.end_t - task.start_t) * 1000.0, 3),
        "args": args,
    }


# --------------------------------------------------------------------- PNG


def _colour(task: Task) -> str:
    if task.kind == RECOMPUTE:
        return _RECOMPUTE_COLOUR
    if task.kind == COMPUTE:
        return _STAGE_KIND_COLOURS.get(task.stage_kind, _STAGE_KIND_COLOURS[""])
    return _KIND_COLOURS.get(task.kind, _OTHER_COLOUR)


def write_png(
    trace: Trace, path: str | os.PathLike[str], *, title: str | None = None, dpi: int = 120
) -> Path:
    """Draw ``trace`` as a PNG timeline: one row per lane per device (the host last), bars
    coloured by kind, compute bars shaded forward / fused / backward, x axis in ms, the bubble
    ratio in the title. Needs matplotlib (``pip install 'roundpipe[plot]'``). Written atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("writing a PNG timeline needs matplotlib: pip install 'roundpipe[plot]'") from exc

    tasks = finished_tasks(trace)
    # Lanes that were never busy (free transfers in a simulation, a host with a 0 ms optimizer)
    # would only be empty rows: leave them out and say so under the axis.
    busy_lanes = {(t.device, t.lane) for t in tasks if t.end_t > t.start_t}
    all_rows = lane_rows(trace)
    rows = [pair for pair in all_rows if pair in busy_lanes] or all_rows
    hidden = len(all_rows) - len(rows)
    row_of = {pair: i for i, pair in enumerate(rows)}
    tasks = [t for t in tasks if (t.device, t.lane) in row_of]

    height = 1.2 + 0.26 * max(len(rows), 1) + 0.8
    fig = Figure(figsize=(15, height), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()

    computes = [t for t in tasks if t.kind in COMPUTE_KINDS]
    t0 = min((t.start_t for t in tasks), default=0.0)
    t1 = max((t.end_t for t in tasks), default=1.0)
    span = max(t1 - t0, 1e-9)
    _draw_bars(ax, tasks, rows, row_of, computes, span)
    _draw_stage_names(ax, computes, row_of, span)

    labels = ["host " + lane_suffix(lane) if d < 0 else f"d{d} {lane_suffix(lane)}" for d, lane in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(t0 - span * 0.005, t1 + span * 0.005)
    ax.set_xlabel("time (ms)" + (f"   ({hidden} idle lanes not shown)" if hidden else ""))
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    # Thin separators between devices.
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="#888888", linewidth=0.5)

    _draw_legend(fig, tasks, computes)

    if title is None:
        title = _default_title(trace)
    ax.set_title(title, fontsize=10)

    def save(f: Any) -> None:
        fig.savefig(f, format="png", dpi=dpi)

    return atomic_write(Path(path), save, mode="wb")


def _draw_bars(
    ax: Any,
    tasks: list[Task],
    rows: list[tuple[int, str]],
    row_of: dict[tuple[int, str], int],
    computes: list[Task],
    span: float,
) -> None:
    # One broken_barh call per (row, colour): a few dozen collections even for 10^5 tasks.
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for task in tasks:
        groups.setdefault((row_of[(task.device, task.lane)], _colour(task)), []).append(
            (task.start_t, max(task.end_t - task.start_t, 0.0))
        )
    raster = len(tasks) > 2000
    # A white hairline between neighbouring compute tasks, when they are wide enough (~4 pt)
    # that it does not wash them out.
    widths = sorted(t.end_t - t.start_t for t in computes)
    separate = bool(widths) and widths[len(widths) // 2] / span * 15 * 72 >= 4
    for (row, colour), spans in groups.items():
        tall = lane_suffix(rows[row][1]) in ("compute", "optimizer")
        h = 0.8 if tall else 0.6
        edge = "white" if tall and separate else "none"
        ax.broken_barh(
            spans, (row - h / 2, h), facecolors=colour, edgecolor=edge, linewidth=0.3, rasterized=raster
        )


# Text sizes in points: a character is about 0.6 of the font size wide; a lane row is about
# 0.26 in (19 pt) high, so a rotated name of a few characters still fits a narrow bar.
_NAME_FONT, _NARROW_FONT, _CHAR_WIDTH = 6.0, 5.0, 0.6
_AXIS_POINTS = 15 * 72 * 0.93  # the figure's width less the lane labels


def _draw_stage_names(ax: Any, computes: list[Task], row_of: dict[tuple[int, str], int], span: float) -> None:
    """Stage names on compute and recompute bars (``B1``, ``B2``: which backward stage a bar is
    matters most in a pipeline): across the bar where it is wide enough, turned upright in a
    smaller font where it is narrow, left out only where not even that fits."""
    if not 0 < len(computes) <= 1500:
        return
    for task in computes:
        name = task.stage or ""
        if not name:
            continue
        width = (task.end_t - task.start_t) / span * _AXIS_POINTS
        across = width >= _CHAR_WIDTH * _NAME_FONT * len(name) + 2
        upright = not across and width >= _NARROW_FONT + 1 and len(name) <= 3
        if not (across or upright):
            continue
        ax.text(
            (task.start_t + task.end_t) / 2,
            row_of[(task.device, task.lane)],
            name,
            ha="center",
            va="center",
            fontsize=_NAME_FONT if across else _NARROW_FONT,
            rotation=0 if across else 90,
            color="white"
            if task.kind == RECOMPUTE or task.stage_kind in (SlotKind.FUSED, SlotKind.BWD)
            else "black",
            clip_on=True,
        )


def _draw_legend(fig: Any, tasks: list[Task], computes: list[Task]) -> None:
    from matplotlib.patches import Patch

    present_kinds = {t.kind for t in tasks}
    present_stage_kinds = {t.stage_kind for t in computes}
    handles = [
        Patch(color=_STAGE_KIND_COLOURS[sk], label=name)
        for sk, name in _STAGE_KIND_NAMES.items()
        if sk in present_stage_kinds
    ]
    if computes and not handles:
        handles.append(Patch(color=_STAGE_KIND_COLOURS[""], label="compute"))
    if RECOMPUTE in present_kinds:
        handles.append(Patch(color=_RECOMPUTE_COLOUR, label="compute: recompute"))
    handles += [Patch(color=c, label=k) for k, c in _KIND_COLOURS.items() if k in present_kinds]
    if handles:
        fig.legend(
            handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False
        )


def _default_title(trace: Trace) -> str:
    report = trace.bubble_ratio()
    bits = [
        f"bubble {report.overall:.1%}",
        f"makespan {report.makespan_ms:.1f} ms",
        f"{len(trace)} tasks",
    ]
    if "num_devices" in trace.meta:
        bits.insert(0, f"{trace.meta['num_devices']} devices")
    if "async_optimizer" in trace.meta:
        bits.insert(1, "async optimizer" if trace.meta["async_optimizer"] else "sync optimizer")
    return "roundpipe schedule: " + ", ".join(bits)
