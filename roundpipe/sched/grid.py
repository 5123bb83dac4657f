"""The ASCII grid: a schedule in a terminal, with the task a rule check blames marked.

Why: a rule violation or a surprising bubble is understood fastest by looking at the lanes around
it, and a terminal is what a failing test or the CLI has. One row per lane, time cut into
columns; ``!`` marks the offending task and ``?`` the tasks it relates to. It only reads a trace
and must never change a task or import torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    COMPUTE_KINDS,
    G_COPY,
    GRAD_DOWN,
    GRAD_UP,
    P_COPY,
    PARAM_UP,
    RECOMPUTE,
    STEP,
    Key,
    Task,
)

if TYPE_CHECKING:
    from roundpipe.sched.rules import RuleViolation
    from roundpipe.sched.trace import Trace
from roundpipe.sched.views import device_rank, finished_tasks, lane_rank, lane_rows, lane_suffix

# --------------------------------------------------------------------- ASCII grid


def _as_key(task_or_key: Task | Key | Sequence[Any]) -> Key:
    if isinstance(task_or_key, Task):
        return task_or_key.key
    return tuple(task_or_key)


def _cell_text(task: Task) -> str:
    if task.kind == COMPUTE:
        return task.stage or "C"
    if task.kind == RECOMPUTE:
        return task.stage.lower() or "c"
    short: dict[str, str] = {
        ACT_UP: "a",
        GRAD_UP: "u",
        ACT_DOWN: "d",
        PARAM_UP: "p",
        GRAD_DOWN: "g",
        G_COPY: "G",
        STEP: "S",
        P_COPY: "P",
    }
    return short.get(task.kind, task.kind[:1])


def _resolve_marks(
    trace: Trace, mark: Task | Key | None, related: Sequence[Task | Key]
) -> tuple[list[tuple[str, Task]], list[Key]]:
    """The tasks to mark, with their symbol (``!`` for ``mark``, ``?`` for ``related``), and the
    keys that name no task of the trace."""
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
    return marks, missing


def _cells(task: Task, lo: float, bucket: float, width: int) -> range:
    """The columns a task covers in a grid starting at ``lo`` ms, ``bucket`` ms per column."""
    c0 = math.floor((task.start_t - lo) / bucket)
    c1 = math.ceil((task.end_t - lo) / bucket - 1e-9)
    c0, c1 = max(c0, 0), min(max(c1, c0 + 1), width)
    return range(c0, c1) if c0 < width and task.end_t >= lo else range(0)


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
    ``width`` columns. A task writes its stage name (``F1``, ``FB``, ``B2``, a backward stage's recompute in lower case, ``b2``; a letter for other
    kinds: a/d act up/down, u grad_up, p param_up, g grad_down, G/S/P g-copy/step/p-copy) into its first
    cells and ``-`` into the rest; ``.`` is idle.

    ``mark`` (a task or a task key) is drawn with ``!`` and named in a caption; ``related`` tasks
    with ``?``. Rows holding a marked task are always shown. ``lanes=None`` shows every lane.
    ``window=(start_ms, end_ms)`` zooms in (default: the whole trace).
    """
    width = max(int(width), 10)
    marks, missing = _resolve_marks(trace, mark, related)
    rows = lane_rows(trace, lanes)
    for _, task in marks:
        if (task.device, task.lane) not in rows:
            rows.append((task.device, task.lane))
    rows.sort(key=lambda p: (device_rank(p[0]), lane_rank(p[1]), p[1]))
    shown = set(rows)
    tasks = [t for t in finished_tasks(trace) if (t.device, t.lane) in shown]
    if not tasks:
        return "(empty trace: nothing ran)"

    lo = min(t.start_t for t in tasks) if window is None else window[0]
    hi = max(t.end_t for t in tasks) if window is None else window[1]
    bucket = max(hi - lo, 1e-9) / width
    labels = [("host." if d < 0 else f"d{d}.") + lane_suffix(lane) for d, lane in rows]
    label_w = max(len(s) for s in labels)
    grid = {pair: ["."] * width for pair in rows}

    def cells(task: Task) -> range:
        return _cells(task, lo, bucket, width)

    for task in sorted(tasks, key=lambda t: (t.start_t, t.seq)):
        row = grid[(task.device, task.lane)]
        span = cells(task)
        text = _cell_text(task)
        for i, c in enumerate(span):
            row[c] = text[i] if i < len(text) else "-"
    for sym, task in marks:
        for c in cells(task):
            grid[(task.device, task.lane)][c] = sym

    body = [f"{label:>{label_w}} |{''.join(grid[pair])}|" for label, pair in zip(labels, rows, strict=True)]
    rule = f"{'':>{label_w}} +{'-' * width}+"
    lines = [f"{'':>{label_w}}  {lo:.2f} ms{'':{max(width - 22, 1)}}{hi:>10.2f} ms", rule, *body, rule]
    lines.append(f"{'':>{label_w}}  1 column = {bucket:.3g} ms; '.' idle")
    for sym, task in marks:
        where = "" if cells(task) else " (outside the window shown)"
        lines.append(f"{sym} {task.describe()} [{task.start_t:.3f}-{task.end_t:.3f} ms]{where}")
    lines += [f"(task {key!r} is not in the trace)" for key in missing]
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
    computes = sorted(
        t.end_t - t.start_t for t in trace.records if t.kind in COMPUTE_KINDS and t.end_t > t.start_t
    )
    typical = computes[len(computes) // 2] if computes else max(hi - lo, 1.0)
    # Wide enough to show the involved tasks and ~20 typical compute tasks around them.
    span = max((hi - lo) * 1.5, typical * 20)
    finished = finished_tasks(trace)
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
