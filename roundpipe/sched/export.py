"""Views of a trace for people: Perfetto/Chrome JSON, a PNG timeline and an ASCII grid.

Why a separate module: a `Trace` is data and must stay importable without optional packages;
everything that only serves a human looking at a schedule lives here. The Perfetto file opens in
ui.perfetto.dev (one process per device, one track per lane), the PNG goes into reports and issues,
and the ASCII grid is what a terminal shows when a rule check fails, with the offending task
marked. This module only reads a trace: it must never change a task, never import torch, and
import matplotlib only inside `write_png`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    DEVICE_LANES,
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    P_COPY,
    PARAM_UP,
    STEP,
    Key,
    Task,
)

if TYPE_CHECKING:
    from roundpipe.sched.rules import RuleViolation
    from roundpipe.sched.trace import Trace

__all__ = [
    "explain_violation",
    "format_grid",
    "lane_rows",
    "task_label",
    "write_perfetto",
    "write_png",
]

HOST_DEVICE = -1
_HOST_LANE_ORDER = ("optimizer",)

# Kind colours (colour-blind friendly-ish, Okabe-Ito based); compute is shaded by stage kind.
_KIND_COLOURS: dict[str, str] = {
    ACT_UP: "#E69F00",
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
_OTHER_COLOUR = "#444444"


# --------------------------------------------------------------------- shared helpers


def _lane_suffix(lane: str) -> str:
    """``"d3.act_up"`` -> ``"act_up"``; ``"host.optimizer"`` -> ``"optimizer"``."""
    return lane.split(".", 1)[1] if "." in lane else lane


def _lane_rank(lane: str) -> tuple[int, str]:
    suffix = _lane_suffix(lane)
    order = DEVICE_LANES + _HOST_LANE_ORDER
    return (order.index(suffix), suffix) if suffix in order else (len(order), suffix)


def _device_rank(device: int) -> tuple[int, int]:
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
        pairs = {(d, lane) for d, lane in pairs if _lane_suffix(lane) in keep}
    return sorted(pairs, key=lambda p: (_device_rank(p[0]), _lane_rank(p[1]), p[1]))


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
    if task.kind == COMPUTE:
        bits = [task.stage or "compute"]
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
    if task.microbatch >= 0 and task.kind in (ACT_UP, ACT_DOWN):
        bits.append(f"mb{task.microbatch}")
    if task.step >= 0 and task.kind in (STEP, P_COPY, G_COPY, GRAD_NORM):
        bits.append(f"s{task.step}")
    return " ".join(bits)


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def _atomic_write(path: Path, write: Any, mode: str = "w") -> Path:
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


def _finished(trace: Trace) -> list[Task]:
    """Tasks with real start/end times (a trace of a failed run can hold unstarted ones)."""
    return [t for t in trace.records if t.start_t >= 0 and t.end_t >= t.start_t]


# --------------------------------------------------------------------- Perfetto


def write_perfetto(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

    One process per device (``"device 0"``, ...; ``"host"`` for device -1, listed last), one
    thread per lane, lanes ordered compute, act_up, act_down, param_up, grad_down. Each task is a
    complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds, ``cat`` its kind and ``args``
    its key, iteration, microbatch, layers, stage and step. The file is written atomically.
    """
    rows = lane_rows(trace)
    devices = sorted({d for d, _ in rows}, key=_device_rank)
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
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": _lane_suffix(lane)}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    for task in sorted(_finished(trace), key=lambda t: (t.start_t, t.seq)):
        args: dict[str, Any] = {
            "key": _json_safe(task.key),
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
        events.append(
            {
                "ph": "X",
                "name": task_label(task),
                "cat": task.kind,
                "pid": pid_of[task.device],
                "tid": tid_of[(task.device, task.lane)],
                "ts": round(task.start_t * 1000.0, 3),
                "dur": round(max(0.0, task.end_t - task.start_t) * 1000.0, 3),
                "args": args,
            }
        )
    report = trace.bubble_ratio()
    other = {
        "generator": "roundpipe",
        "tasks": len(trace),
        "bubble_ratio": report.overall,
        "makespan_ms": report.makespan_ms,
    }
    for key in ("num_devices", "async_optimizer"):
        if key in trace.meta:
            other[key] = _json_safe(trace.meta[key])
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    return _atomic_write(Path(path), lambda f: json.dump(document, f, separators=(",", ":")))


# --------------------------------------------------------------------- PNG


def _colour(task: Task) -> str:
    if task.kind == COMPUTE:
        return _STAGE_KIND_COLOURS.get(task.stage_kind, _STAGE_KIND_COLOURS[""])
    return _KIND_COLOURS.get(task.kind, _OTHER_COLOUR)


def write_png(
    trace: Trace, path: str | os.PathLike[str], *, title: str | None = None, dpi: int = 120
) -> Path:
    """Draw ``trace`` as a PNG timeline: one row per lane per device (the host last), bars
    coloured by kind, compute bars shaded forward / fused / backward, x axis in ms, the bubble
    ratio in the title. Needs matplotlib (``pip install roundpipe[plot]``). Written atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("writing a PNG timeline needs matplotlib: pip install roundpipe[plot]") from exc

    tasks = _finished(trace)
    # Lanes that were never busy (free transfers in a simulation, a host with a 0 ms optimizer)
    # would only be empty rows: leave them out and say so under the axis.
    busy_lanes = {(t.device, t.lane) for t in tasks if t.end_t > t.start_t}
    all_rows = lane_rows(trace)
    rows = [pair for pair in all_rows if pair in busy_lanes] or all_rows
    hidden = len(all_rows) - len(rows)
    row_of = {pair: i for i, pair in enumerate(rows)}
    tasks = [t for t in tasks if (t.device, t.lane) in row_of]
    report = trace.bubble_ratio()

    height = 1.2 + 0.26 * max(len(rows), 1) + 0.8
    fig = Figure(figsize=(15, height), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()

    # One broken_barh call per (row, colour): a few dozen collections even for 10^5 tasks.
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for task in tasks:
        groups.setdefault((row_of[(task.device, task.lane)], _colour(task)), []).append(
            (task.start_t, max(task.end_t - task.start_t, 0.0))
        )
    raster = len(tasks) > 2000
    t0 = min((t.start_t for t in tasks), default=0.0)
    t1 = max((t.end_t for t in tasks), default=1.0)
    span = max(t1 - t0, 1e-9)
    computes = [t for t in tasks if t.kind == COMPUTE]
    # A white hairline between neighbouring compute tasks, when they are wide enough (~4 pt)
    # that it does not wash them out.
    widths = sorted(t.end_t - t.start_t for t in computes)
    separate = bool(widths) and widths[len(widths) // 2] / span * 15 * 72 >= 4
    for (row, colour), spans in groups.items():
        tall = _lane_suffix(rows[row][1]) in ("compute", "optimizer")
        h = 0.8 if tall else 0.6
        edge = "white" if tall and separate else "none"
        ax.broken_barh(
            spans, (row - h / 2, h), facecolors=colour, edgecolor=edge, linewidth=0.3, rasterized=raster
        )

    # Stage names on compute bars when they are wide enough to read.
    if 0 < len(computes) <= 600:
        for task in computes:
            if (task.end_t - task.start_t) / span * 15 * 72 >= 9 * max(len(task.stage), 1):
                ax.text(
                    (task.start_t + task.end_t) / 2,
                    row_of[(task.device, task.lane)],
                    task.stage,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if task.stage_kind in (SlotKind.FUSED, SlotKind.BWD) else "black",
                    clip_on=True,
                )

    labels = ["host " + _lane_suffix(lane) if d < 0 else f"d{d} {_lane_suffix(lane)}" for d, lane in rows]
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

    present_kinds = {t.kind for t in tasks}
    present_stage_kinds = {t.stage_kind for t in computes}
    handles = [
        Patch(color=_STAGE_KIND_COLOURS[sk], label=name)
        for sk, name in _STAGE_KIND_NAMES.items()
        if sk in present_stage_kinds
    ]
    if computes and not handles:
        handles.append(Patch(color=_STAGE_KIND_COLOURS[""], label="compute"))
    handles += [Patch(color=c, label=k) for k, c in _KIND_COLOURS.items() if k in present_kinds]
    if handles:
        fig.legend(
            handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False
        )

    if title is None:
        bits = [
            f"bubble {report.overall:.1%}",
            f"makespan {report.makespan_ms:.1f} ms",
            f"{len(trace)} tasks",
        ]
        if "num_devices" in trace.meta:
            bits.insert(0, f"{trace.meta['num_devices']} devices")
        if "async_optimizer" in trace.meta:
            bits.insert(1, "async optimizer" if trace.meta["async_optimizer"] else "sync optimizer")
        title = "roundpipe schedule: " + ", ".join(bits)
    ax.set_title(title, fontsize=10)

    def save(f: Any) -> None:
        fig.savefig(f, format="png", dpi=dpi)

    return _atomic_write(Path(path), save, mode="wb")


# --------------------------------------------------------------------- ASCII grid


def _as_key(task_or_key: Task | Key | Sequence[Any]) -> Key:
    if isinstance(task_or_key, Task):
        return task_or_key.key
    return tuple(task_or_key)


def _cell_text(task: Task) -> str:
    if task.kind == COMPUTE:
        return task.stage or "C"
    short: dict[str, str] = {
        ACT_UP: "a",
        ACT_DOWN: "d",
        PARAM_UP: "p",
        GRAD_DOWN: "g",
        G_COPY: "G",
        STEP: "S",
        P_COPY: "P",
    }
    return short.get(task.kind, task.kind[:1])


def format_grid(
    trace: Trace,
    *,
    mark: Task | Key | None = None,
    width: int = 100,
    lanes: Iterable[str] | None = ("compute",),
    related: Sequence[Task | Key] = (),
    window: tuple[float, float] | None = None,
) -> str:
    """An ASCII timeline: one row per lane (by default each device's compute lane), time cut into
    ``width`` columns. A task writes its stage name (``F1``, ``FB``, ``B2``; a letter for other
    kinds: a/d act up/down, p param_up, g grad_down, G/S/P g-copy/step/p-copy) into its first
    cells and ``-`` into the rest; ``.`` is idle.

    ``mark`` (a task or a task key) is drawn with ``!`` and named in a caption; ``related`` tasks
    with ``?``. Rows holding a marked task are always shown. ``lanes=None`` shows every lane.
    ``window=(start_ms, end_ms)`` zooms in (default: the whole trace).
    """
    width = max(int(width), 10)
    by_key = {t.key: t for t in trace.records}
    marks: list[tuple[str, Task]] = []
    missing: list[Key] = []
    for sym, items in (("!", [mark] if mark is not None else []), ("?", list(related))):
        for item in items:
            key = _as_key(item)
            found = by_key.get(key) if not isinstance(item, Task) else item
            if found is None:
                missing.append(key)
            else:
                marks.append((sym, found))

    rows = lane_rows(trace, lanes)
    for _, task in marks:
        if (task.device, task.lane) not in rows:
            rows.append((task.device, task.lane))
    rows.sort(key=lambda p: (_device_rank(p[0]), _lane_rank(p[1]), p[1]))
    shown = set(rows)
    tasks = [t for t in _finished(trace) if (t.device, t.lane) in shown]
    if not tasks:
        return "(empty trace: nothing ran)"

    lo = min(t.start_t for t in tasks) if window is None else window[0]
    hi = max(t.end_t for t in tasks) if window is None else window[1]
    bucket = max(hi - lo, 1e-9) / width
    labels = [("host." if d < 0 else f"d{d}.") + _lane_suffix(lane) for d, lane in rows]
    label_w = max(len(s) for s in labels)
    grid = {pair: ["."] * width for pair in rows}

    def cells(task: Task) -> range:
        c0 = math.floor((task.start_t - lo) / bucket)
        c1 = math.ceil((task.end_t - lo) / bucket - 1e-9)
        c0, c1 = max(c0, 0), min(max(c1, c0 + 1), width)
        return range(c0, c1) if c0 < width and task.end_t >= lo else range(0)

    for task in sorted(tasks, key=lambda t: (t.start_t, t.seq)):
        row = grid[(task.device, task.lane)]
        span = cells(task)
        text = _cell_text(task)
        for i, c in enumerate(span):
            row[c] = text[i] if i < len(text) else "-"
    for sym, task in marks:
        for c in cells(task):
            grid[(task.device, task.lane)][c] = sym

    lines = [
        f"{'':>{label_w}}  {lo:.2f} ms{'':{max(width - 22, 1)}}{hi:>10.2f} ms",
        f"{'':>{label_w}} +{'-' * width}+",
    ]
    for label, pair in zip(labels, rows, strict=True):
        lines.append(f"{label:>{label_w}} |{''.join(grid[pair])}|")
    lines.append(f"{'':>{label_w}} +{'-' * width}+")
    lines.append(f"{'':>{label_w}}  1 column = {bucket:.3g} ms; '.' idle")
    for sym, task in marks:
        where = "" if cells(task) else " (outside the window shown)"
        lines.append(f"{sym} {task.describe()} [{task.start_t:.3f}-{task.end_t:.3f} ms]{where}")
    for key in missing:
        lines.append(f"(task {key!r} is not in the trace)")
    return "\n".join(lines)


def explain_violation(trace: Trace, violation: RuleViolation, *, width: int = 100) -> str:
    """The violation's message, then a grid zoomed on its tasks: the first marked ``!``, the
    others ``?``, every lane they ran on shown next to the devices' compute lanes."""
    tasks = [t for t in violation.tasks if t.start_t >= 0]
    header = str(violation)
    if not tasks:
        return header + "\n" + format_grid(trace, width=width)
    lo = min(t.start_t for t in tasks)
    hi = max(t.end_t for t in tasks)
    computes = sorted(t.end_t - t.start_t for t in trace.records if t.kind == COMPUTE and t.end_t > t.start_t)
    typical = computes[len(computes) // 2] if computes else max(hi - lo, 1.0)
    # Wide enough to show the involved tasks and ~20 typical compute tasks around them.
    span = max((hi - lo) * 1.5, typical * 20)
    finished = _finished(trace)
    t_min = min((t.start_t for t in finished), default=lo)
    t_max = max((t.end_t for t in finished), default=hi)
    centre = (lo + hi) / 2
    start = max(t_min, centre - span / 2)
    end = min(t_max, start + span)
    start = max(t_min, min(start, end - span))
    grid = format_grid(
        trace,
        mark=tasks[0],
        related=tasks[1:],
        width=width,
        window=(start, max(end, start + 1e-6)),
    )
    return f"{header}\n{grid}"
