"""Where a run's time went, per device, from its trace: busy, bubble, exposed transfer, host-bound.

The bubble says how long a GPU sat idle; it does not say why. The one cause a schedule is built
to hide is transfer time, so this module separates it out: the share of the time a device's
compute lane sat idle while a transfer its next compute task was waiting for was still running.
A benchmark reads these numbers after its measured iterations; a test reads them on simulated
traces, where the link speed is known.

Busy is not the same as useful on a backend that issues ahead (CUDA): a compute task's device
interval opens when its stream reaches it, and if the host is still issuing its kernels then, the
device runs them as they arrive, at the host's pace. ``host_bound`` is the share of the window in
which a device ran a compute task the host had not finished issuing: time the GPU waited for the
host inside a task, which the bubble does not see.

It reads tasks only through their public fields (kind, lane, device, iteration, step, deps,
key, start_t, end_t, issue_t) and must never import torch or know how a task ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE_KINDS,
    G_COPY,
    GRAD_DOWN,
    GRAD_UP,
    PARAM_UP,
    Key,
    Task,
)

TRANSFER_KINDS = frozenset({ACT_UP, GRAD_UP, ACT_DOWN, PARAM_UP, GRAD_DOWN})

Interval = tuple[float, float]


@dataclass(frozen=True)
class DeviceBreakdown:
    """One device over the window. Times in ms; fractions are of the window's length."""

    device: int
    busy_ms: float
    bubble: float
    exposed_transfer_ms: float
    exposed_transfer: float
    exposed_ms_by_kind: dict[str, float] = field(default_factory=dict)
    host_bound_ms: float = 0.0
    host_bound: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "busy_ms": round(self.busy_ms, 3),
            "host_bound_ms": round(self.host_bound_ms, 3),
            "host_bound": round(self.host_bound, 5),
            "bubble": round(self.bubble, 5),
            "exposed_transfer_ms": round(self.exposed_transfer_ms, 3),
            "exposed_transfer": round(self.exposed_transfer, 5),
            "exposed_ms_by_kind": {k: round(v, 3) for k, v in sorted(self.exposed_ms_by_kind.items())},
        }


@dataclass(frozen=True)
class TraceBreakdown:
    """The measured iterations of a trace, broken down (see `breakdown` for the definitions)."""

    iterations: tuple[int, ...]
    window_ms: Interval
    devices: dict[int, DeviceBreakdown]
    bubble: float
    exposed_transfer: float
    busy_ms_per_iteration: dict[str, float]
    host_bound: float = 0.0
    issue_ms_per_iteration: dict[str, float] = field(default_factory=dict)

    @property
    def span_ms(self) -> float:
        return self.window_ms[1] - self.window_ms[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "iterations": list(self.iterations),
            "window_ms": round(self.span_ms, 3),
            "bubble": round(self.bubble, 5),
            "exposed_transfer": round(self.exposed_transfer, 5),
            "host_bound": round(self.host_bound, 5),
            "devices": {str(d): b.to_dict() for d, b in sorted(self.devices.items())},
            "busy_ms_per_iteration": {k: round(v, 3) for k, v in sorted(self.busy_ms_per_iteration.items())},
            "issue_ms_per_iteration": {
                k: round(v, 3) for k, v in sorted(self.issue_ms_per_iteration.items())
            },
        }


def breakdown(trace: Iterable[Task], iterations: Iterable[int] | None = None) -> TraceBreakdown:
    """Break down the iterations ``iterations`` (default: every iteration in the trace) of a trace.

    Window W: from the earliest start to the latest end of the compute tasks of those iterations;
    the same window for every device, so pipeline fill and drain count against each device.

    Per device d (every device with a compute task in the window):
      - busy_ms: the length of the union of d's compute intervals (any iteration) inside W;
      - bubble: 1 - busy_ms / |W|;
      - exposed transfer: each idle gap of d's compute lane ends where a compute task C starts
        (the gap before d's first compute begins at -inf; a gap after d's last compute in the
        trace has no C and counts as not exposed). A transfer task (act_up, act_down, param_up,
        grad_down) *feeds* C when it is in C.deps, or in the deps of a transfer that feeds C
        (an act_down on the upstream device -> the act_up on d -> C). The exposed time of the
        gap is the length of the union of the feeding transfers' [start_t, end_t) intervals
        clipped to the gap and to W: time in which d had nothing to run and the next thing it
        ran was waiting for bytes still moving. exposed_transfer = exposed ms / |W|, at most
        the bubble. Transfers feeding later computes (prefetch) never count: the gap did not
        wait for them. ``exposed_ms_by_kind`` is the same per transfer kind (kinds that ran
        at the same moment each count it, so these may sum to more than the total);
      - host_bound: the union over d's compute tasks of [start_t, min(end_t, issue_t)) inside W,
        over |W|: the device was running a task whose issuing the host had not finished (tasks
        without an issue time, from backends that complete on return, count nothing).
    Overall bubble, exposed_transfer and host_bound: the mean over devices.

    busy_ms_per_iteration, per task kind: the summed durations of the tasks of those iterations,
    plus the optimizer-lane tasks without an iteration (step, p_copy, grad_norm) of the optimizer
    steps the iterations' G-copies feed, divided by the number of iterations.

    issue_ms_per_iteration, per compute kind: the host's time issuing those iterations' compute
    tasks, divided by the number of iterations. A lane issues one task at a time, so a task's
    issuing runs from when its lane could take it (its ready time, or the lane's previous task
    issued, whichever is later) to its issue time. Next to the same kind's busy time it says which
    of the two paces the compute lane: the host issuing or the device running (only backends that
    issue ahead, CUDA, have issue times apart from their end).
    """
    tasks = list(trace)
    wanted = _iterations(tasks, iterations)
    measured = [t for t in tasks if t.kind in COMPUTE_KINDS and t.iteration in wanted]
    if not measured:
        return TraceBreakdown(tuple(sorted(wanted)), (0.0, 0.0), {}, 0.0, 0.0, {})
    window = (min(t.start_t for t in measured), max(t.end_t for t in measured))
    by_key = {t.key: t for t in tasks}
    devices = sorted({t.device for t in measured})
    per_device = {
        d: _device(d, [t for t in tasks if t.kind in COMPUTE_KINDS and t.device == d], by_key, window)
        for d in devices
    }
    return TraceBreakdown(
        iterations=tuple(sorted(wanted)),
        window_ms=window,
        devices=per_device,
        bubble=sum(b.bubble for b in per_device.values()) / len(per_device),
        exposed_transfer=sum(b.exposed_transfer for b in per_device.values()) / len(per_device),
        busy_ms_per_iteration=_busy_per_kind(tasks, wanted),
        host_bound=sum(b.host_bound for b in per_device.values()) / len(per_device),
        issue_ms_per_iteration=_issue_per_kind(tasks, wanted),
    )


def _iterations(tasks: list[Task], iterations: Iterable[int] | None) -> set[int]:
    if iterations is None:
        return {t.iteration for t in tasks if t.iteration >= 0}
    return set(iterations)


def _device(device: int, computes: list[Task], by_key: dict[Key, Task], window: Interval) -> DeviceBreakdown:
    lo, hi = window
    span = max(hi - lo, 1e-12)
    computes.sort(key=lambda t: (t.start_t, t.end_t))
    busy = _measure(_clip(_union((t.start_t, t.end_t) for t in computes), window))
    exposed: list[Interval] = []
    by_kind: dict[str, list[Interval]] = {}
    covered = float("-inf")  # end of the compute intervals seen so far (they may overlap)
    for task in computes:
        gap = (max(covered, lo), min(task.start_t, hi))
        covered = max(covered, task.end_t)
        if gap[1] <= gap[0]:
            continue
        for feeder in _feeders(task, by_key):
            piece = (max(feeder.start_t, gap[0]), min(feeder.end_t, gap[1]))
            if piece[1] > piece[0]:
                exposed.append(piece)
                by_kind.setdefault(feeder.kind, []).append(piece)
    exposed_ms = _measure(_union(exposed))
    busy = min(busy, span)
    waiting = _union((t.start_t, min(t.end_t, t.issue_t)) for t in computes if t.issue_t >= 0)
    host_bound_ms = _measure(_clip(waiting, window))
    return DeviceBreakdown(
        device=device,
        busy_ms=busy,
        bubble=min(1.0, max(0.0, 1.0 - busy / span)),
        exposed_transfer_ms=exposed_ms,
        exposed_transfer=min(1.0, exposed_ms / span),
        exposed_ms_by_kind={k: _measure(_union(v)) for k, v in by_kind.items()},
        host_bound_ms=host_bound_ms,
        host_bound=min(1.0, host_bound_ms / span),
    )


def _feeders(compute: Task, by_key: dict[Key, Task]) -> list[Task]:
    """Transfers in ``compute``'s deps, and transfers those transfers depend on, transitively."""
    found: dict[Key, Task] = {}
    stack = list(compute.deps)
    while stack:
        dep = by_key.get(stack.pop())  # missing: trimmed from the trace, or never recorded
        if dep is None or dep.kind not in TRANSFER_KINDS or dep.key in found:
            continue
        found[dep.key] = dep
        stack.extend(dep.deps)
    return list(found.values())


def _busy_per_kind(tasks: list[Task], wanted: set[int]) -> dict[str, float]:
    steps = {t.step for t in tasks if t.kind == G_COPY and t.iteration in wanted and t.step >= 0}
    totals: dict[str, float] = {}
    for task in tasks:
        belongs = task.iteration in wanted if task.iteration >= 0 else task.step in steps
        if belongs and task.end_t >= task.start_t >= 0:
            totals[task.kind] = totals.get(task.kind, 0.0) + task.duration
    return {k: v / max(len(wanted), 1) for k, v in totals.items()}


def pacing(trace: Iterable[Task]) -> str | None:
    """One line on what paces the compute lanes: per compute kind and iteration, the host's time
    issuing against the devices' time running, over the last two iterations (of two, the second:
    the first compiles; a short run's re-plan compiles again, so earlier ones may too); None for a
    trace from a backend that completes tasks as it issues them (no task issued before it
    ended), where the question does not arise."""
    tasks = list(trace)
    computes = [t for t in tasks if t.kind in COMPUTE_KINDS and t.issue_t >= 0 and t.iteration >= 0]
    if not any(t.issue_t < t.end_t for t in computes):
        return None
    iterations = sorted({t.iteration for t in computes})
    measured = iterations[-2:] if len(iterations) > 2 else (iterations[1:] or iterations)
    report = breakdown(tasks, measured)
    issued = report.issue_ms_per_iteration
    ran = {kind: report.busy_ms_per_iteration.get(kind, 0.0) for kind in issued}
    parts = [f"{kind} issued in {issued[kind]:.1f} ms, run in {ran[kind]:.1f}" for kind in sorted(issued)]
    who = "the host paces" if sum(issued.values()) > sum(ran.values()) else "the devices pace"
    span = f"{measured[0]}" if len(measured) == 1 else f"{measured[0]}-{measured[-1]}"
    return (
        f"iterations {span}, per iteration: {'; '.join(parts)} ({who} the compute lanes; "
        f"host-bound {report.host_bound:.1%})"
    )


def _issue_per_kind(tasks: list[Task], wanted: set[int]) -> dict[str, float]:
    by_lane: dict[str, list[Task]] = {}
    for task in tasks:
        if task.kind in COMPUTE_KINDS and task.issue_t >= 0 and task.ready_t >= 0:
            by_lane.setdefault(task.lane, []).append(task)
    totals: dict[str, float] = {}
    for lane_tasks in by_lane.values():
        lane_tasks.sort(key=lambda t: t.issue_t)
        previous = float("-inf")
        for task in lane_tasks:
            if task.iteration in wanted:
                spent = max(0.0, task.issue_t - max(task.ready_t, previous))
                totals[task.kind] = totals.get(task.kind, 0.0) + spent
            previous = task.issue_t
    return {k: v / max(len(wanted), 1) for k, v in totals.items()}


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _measure(intervals: list[Interval]) -> float:
    return sum((b - a for a, b in intervals), 0.0)
