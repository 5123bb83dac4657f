"""Why each device's compute lane sat idle: every gap, what the next compute waited for, and why
that was late.

Why: the breakdown (`roundpipe.sched.breakdown`) says how much of a step the GPU idled and how much
of it a transfer was running; it does not say why the transfer was late. On a backend that issues
ahead (CUDA) a transfer can be late in several ways, each with its own remedy: the host issued it
late (the host is the bound), it moved its bytes while the GPU waited (the link is the bound, or
the upload started late), it sat on its stream behind another task, which was itself waiting for
something (the order in which the host issued work), or it waited for another stream's copy to
leave the link. This module walks the dependencies of
the task after each gap back to that cause, from the trace alone.

For each gap of at least ``min_ms`` between two compute tasks of one device, within the chosen
iterations, the next compute task C and each dependency F of C that ended after the gap began,
classified by what F waited for:
  - ``issued late``: the host issued F after the gap began (backends that issue ahead record
    when; on the others a task is issued when it starts, and this never applies);
  - ``behind``: F started when the task before it on its lane ended, later than F's own
    dependencies ended: it was queued behind that task (named, with why that task was late);
  - ``waited for``: F started when one of its own dependencies ended (named);
  - ``behind on the link``: F started when another transfer of its device and direction ended,
    later than its dependencies and its lane allowed (named): as if the copy engine served the
    copies of all streams in the order they reached it (the fake stream backend's shared link
    does; on a GPU, a coincidence of times is what this reads);
  - ``moving``: F had started before the gap began and was still moving its bytes.
A dependency that is itself a compute task (the previous microbatch) is not a cause: the gap
follows it.

It reads tasks only through their public fields and must never import torch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE_KINDS,
    GRAD_DOWN,
    GRAD_UP,
    PARAM_UP,
    Key,
    Task,
)

UPLOADS = frozenset({ACT_UP, GRAD_UP, PARAM_UP})
DOWNLOADS = frozenset({ACT_DOWN, GRAD_DOWN})
SLACK_MS = 0.05
"""Two times this close are the same instant (device timing events are ~microsecond-exact)."""


@dataclass(frozen=True)
class Late:
    """One dependency of a gap's next compute that ended after the gap began."""

    task: Task
    why: str  # "issued late", "behind", "waited for", "behind on the link" or "moving"
    cause: Task | None  # the lane predecessor ("behind"), the dependency ("waited for") or the
    # other transfer ("behind on the link")
    cause_why: str = ""  # for "behind": why that predecessor was late, in words


@dataclass(frozen=True)
class Gap:
    """An idle stretch of a device's compute lane and what the next compute waited for."""

    device: int
    start_ms: float
    end_ms: float
    next_task: Task
    late: tuple[Late, ...]

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms


def find_gaps(
    trace: Iterable[Task], iterations: Iterable[int] | None = None, min_ms: float = 0.5
) -> list[Gap]:
    """The gaps of every device's compute lane within ``iterations`` (default: the last two of
    the trace), longest first; see the module docstring."""
    tasks = list(trace)
    by_key: dict[Key, Task] = {t.key: t for t in tasks}
    wanted = set(iterations) if iterations is not None else last_iterations(tasks)
    lanes: dict[str, list[Task]] = {}
    for task in tasks:
        lanes.setdefault(task.lane, []).append(task)
    for lane_tasks in lanes.values():
        lane_tasks.sort(key=lambda t: (t.start_t, t.seq))
    before = {
        t.key: lane_tasks[i - 1] for lane_tasks in lanes.values() for i, t in enumerate(lane_tasks) if i
    }
    link = _Link(tasks)
    gaps: list[Gap] = []
    computes = [t for t in tasks if t.kind in COMPUTE_KINDS]  # any iteration's fills a gap
    for device in sorted({t.device for t in computes}):
        ordered = sorted((t for t in computes if t.device == device), key=lambda t: t.start_t)
        for previous, task in itertools.pairwise(ordered):
            if task.iteration not in wanted or task.start_t - previous.end_t < min_ms:
                continue
            late = tuple(
                _why(dep, previous.end_t, by_key, before, link)
                for key in task.deps
                if (dep := by_key.get(key)) is not None
                and dep.kind not in COMPUTE_KINDS
                and dep.end_t > previous.end_t + SLACK_MS
            )
            gaps.append(Gap(device, previous.end_t, task.start_t, task, late))
    gaps.sort(key=lambda g: -g.ms)
    return gaps


def last_iterations(trace: Iterable[Task], count: int = 2) -> set[int]:
    """The last ``count`` iterations with compute tasks in the trace (what `find_gaps` reads by
    default)."""
    present = sorted({t.iteration for t in trace if t.kind in COMPUTE_KINDS and t.iteration >= 0})
    return set(present[-count:])


class _Link:
    """Per device and direction (host to device, device to host), the transfers by end time: which
    one a transfer that started late began as it ended (``behind on the link``, module docstring)."""

    def __init__(self, tasks: list[Task]) -> None:
        self.ends: dict[tuple[int, bool], list[tuple[float, int, Task]]] = {}
        for task in tasks:
            if task.kind in UPLOADS or task.kind in DOWNLOADS:
                self.ends.setdefault((task.device, task.kind in UPLOADS), []).append(
                    (task.end_t, task.seq, task)
                )
        for ends in self.ends.values():
            ends.sort(key=lambda e: (e[0], e[1]))

    def ended_at(self, task: Task, after: float) -> Task | None:
        """A transfer of ``task``'s device and direction that ended when ``task`` started, later than
        ``after`` (what else ``task`` waited for)."""
        ends = self.ends.get((task.device, task.kind in UPLOADS), [])
        i = bisect.bisect_left(ends, task.start_t - SLACK_MS, key=lambda e: e[0])
        for end, _, other in ends[i:]:
            if end > task.start_t + SLACK_MS:
                break
            if other is not task and end > after + SLACK_MS:
                return other
        return None


def _why(task: Task, gap_start: float, by_key: dict[Key, Task], before: dict[Key, Task], link: _Link) -> Late:
    """What ``task``, which ended after ``gap_start``, waited for."""
    if _issued_after(task, gap_start):
        return Late(task, "issued late", None)
    if task.start_t <= gap_start + SLACK_MS:
        return Late(task, "moving", None)
    waited = _last_dependency(task, by_key)
    deps_end = waited.end_t if waited is not None else float("-inf")
    ahead = before.get(task.key)
    if (
        ahead is not None
        and abs(ahead.end_t - task.start_t) <= SLACK_MS
        and ahead.end_t > deps_end + SLACK_MS
    ):
        return Late(task, "behind", ahead, _ahead_why(ahead, by_key, link))
    if waited is not None and abs(waited.end_t - task.start_t) <= SLACK_MS:
        return Late(task, "waited for", waited)
    lane_end = ahead.end_t if ahead is not None else float("-inf")
    other = link.ended_at(task, max(deps_end, lane_end, task.issue_t))
    if other is not None:
        return Late(task, "behind on the link", other)
    return Late(task, "moving", None)


def _issued_after(task: Task, at: float) -> bool:
    """Whether the host finished issuing ``task`` after ``at`` (only a backend that issues ahead
    records when; elsewhere ``issue_t`` is -1)."""
    return task.issue_t >= 0 and task.issue_t > at + SLACK_MS


def _last_dependency(task: Task, by_key: dict[Key, Task]) -> Task | None:
    """The dependency of ``task`` in the trace that ended last."""
    deps = [d for key in task.deps if (d := by_key.get(key)) is not None]
    return max(deps, key=lambda d: d.end_t, default=None)


def _ahead_why(task: Task, by_key: dict[Key, Task], link: _Link) -> str:
    """When the task a late transfer queued behind was issued, what it waited for, and what held
    it on the link after that: the facts, on the task's own clock (its start)."""
    waited = _last_dependency(task, by_key)
    bits = []
    if task.issue_t >= 0:  # a backend that issues ahead records it
        bits.append(f"issued {task.issue_t - task.start_t:+.2f} ms from its start")
    if waited is not None:
        bits.append(f"its last dependency, {waited.describe()}, ended {waited.end_t - task.start_t:+.2f}")
    other = link.ended_at(task, max(waited.end_t if waited else float("-inf"), task.issue_t))
    if other is not None:
        bits.append(f"then behind {other.describe()} on the link")
    return "; ".join(bits)


def format_gaps(gaps: list[Gap], trace: Iterable[Task], window_ms: float | None = None, top: int = 20) -> str:
    """A heading with the gaps' total by the next compute's kind, then the ``top`` longest, each
    with its late dependencies (a stage's weight upload as one line: when all its parts ran)."""
    runs: dict[tuple[int, int, int, int], list[Task]] = {}
    for task in trace:
        if task.kind == PARAM_UP:
            runs.setdefault((task.device, task.iteration, task.round, task.slot), []).append(task)
    total = sum(g.ms for g in gaps)
    by_kind: dict[str, float] = {}
    for gap in gaps:
        kind = f"{gap.next_task.kind} {gap.next_task.stage_kind}".strip()
        by_kind[kind] = by_kind.get(kind, 0.0) + gap.ms
    share = f" of {window_ms:.1f} ms ({total / window_ms:.1%})" if window_ms else ""
    kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    lines = [f"{len(gaps)} gaps, {total:.1f} ms{share}; before: {kinds or 'nothing'}"]
    for gap in gaps[:top]:
        lines.append(f"{gap.ms:8.2f} ms on device {gap.device} before {gap.next_task.describe()}")
        lines += [f"           {line}" for line in _late_lines(gap, runs)]
    return "\n".join(lines)


def _late_lines(gap: Gap, runs: dict[tuple[int, int, int, int], list[Task]]) -> list[str]:
    groups: dict[tuple[object, ...], list[Late]] = {}
    for late in gap.late:
        t = late.task
        why = "" if t.kind == PARAM_UP else late.why  # one line per upload, whatever each part waited for
        groups.setdefault((t.kind, t.iteration, t.slot, t.microbatch, why), []).append(late)
    lines = []
    for members in groups.values():
        if members[0].task.kind == PARAM_UP:
            lines.append(_upload_line(gap, members, runs))
            continue
        first = min(members, key=lambda m: m.task.start_t)
        last = max(members, key=lambda m: m.task.end_t)
        name = first.task.describe() if len(members) == 1 else f"{first.task.kind} ({len(members)} parts)"
        span = f"ran +{first.task.start_t - gap.start_ms:.2f} to +{last.task.end_t - gap.start_ms:.2f} ms"
        what = {"issued late": "issued late by the host", "moving": "moving its bytes"}.get(
            first.why, first.why
        )
        if first.cause is not None:
            what += f" {first.cause.describe()}"
        if first.cause_why:
            what += f" ({first.cause_why})"
        lines.append(f"{name}: {span}, {what}")
    task = gap.next_task
    if _issued_after(task, gap.start_ms):
        lines.insert(0, f"the compute itself issued late by the host: {task.issue_t - gap.start_ms:+.2f} ms")
    return lines or ["no dependency ended late and it was issued in time (a host task held it?)"]


def _upload_line(gap: Gap, members: list[Late], runs: dict[tuple[int, int, int, int], list[Task]]) -> str:
    """A stage's weight upload: its parts still moving at the gap, when the whole upload ran, and
    when its first part was issued (after the run it waits for, one stage of prefetch)."""
    t = members[0].task
    parts = runs.get((t.device, t.iteration, t.round, t.slot), [t])
    first = min(parts, key=lambda p: p.start_t)
    last = max(parts, key=lambda p: p.end_t)
    at = gap.start_ms
    issued = min((p.issue_t for p in parts if p.issue_t >= 0), default=None)
    line = (
        f"its stage's weights, {len(members)} of {len(parts)} parts late: the upload ran "
        f"{first.start_t - at:+.2f} to {last.end_t - at:+.2f} ms"
    )
    if issued is not None:
        line += f", its first part issued {issued - at:+.2f}"
    return line


def gap_causes(gaps: list[Gap]) -> dict[str, float]:
    """Milliseconds of the gaps by cause: each gap counted once, under what the dependency that
    ended last waited for ("weights" for a stage's parameter upload; "compute issued late" when the
    next compute was issued after the gap began and no dependency ended later; "other" when
    neither explains it)."""
    causes: dict[str, float] = {}
    for gap in gaps:
        last = max(gap.late, key=lambda late: late.task.end_t, default=None)
        if last is not None:
            label = "weights" if last.task.kind == PARAM_UP else f"{last.task.kind}: {last.why}"
        elif _issued_after(gap.next_task, gap.start_ms):
            label = "compute issued late"
        else:
            label = "other"
        causes[label] = causes.get(label, 0.0) + gap.ms
    return dict(sorted(causes.items(), key=lambda kv: -kv[1]))


def gaps_report(trace: Iterable[Task], top: int = 20, min_ms: float = 0.5) -> str:
    """`format_gaps` of the trace's last two iterations, against their window (the first of their
    computes' starts to the last one's end): what ``roundpipe trace gaps`` prints."""
    tasks = list(trace)
    wanted = last_iterations(tasks)
    computes = [t for t in tasks if t.kind in COMPUTE_KINDS and t.iteration in wanted]
    if not computes:
        return "no compute tasks in the trace"
    window = max(t.end_t for t in computes) - min(t.start_t for t in computes)
    heading = f"iterations {', '.join(str(i) for i in sorted(wanted))}: "
    return heading + format_gaps(find_gaps(tasks, wanted, min_ms), tasks, window, top)
