"""The trace: what ran, where and when, kept as data.

A `Trace` is the finished tasks in completion order. Everything people ask of a schedule is a
question about it: how idle were the devices (`bubble_ratio`), did the run obey the five rules
(`check_rules`), what did it look like (`to_perfetto`, `plot`), and would it run the same way
again (`replay` on the fake backend with the recorded durations). It is saved as plain JSON so a
trace from a real run can be inspected or replayed anywhere.

A trace never holds tensors. It keeps the data and the questions about it; the readers that do
more with it live beside it and import it, never the reverse: rule checking in
`roundpipe.sched.rules`, export and plotting in `roundpipe.sched.export` (so this module stays free
of optional dependencies), replay in `roundpipe.planning.simulate` (above the backends). The methods that
reach them (`check_rules`, `to_perfetto`, `plot`, `replay`) call the `TraceReaders` the package
attaches when it loads (`roundpipe.sched.__init__`, which runs before this module can be
imported), so this module imports none of them and no import cycle runs through it.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

from roundpipe.sched.task import COMPUTE_KINDS, Task

TRACE_FORMAT = "roundpipe.trace/1"


def _json_type(value: Any) -> str:
    """How JSON names the type of a parsed value (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


class TraceReaders(NamedTuple):
    """What the `Trace` methods that leave this module call: rule checking, export, replay."""

    check_rules: Callable[[Trace], None]
    write_perfetto: Callable[[Trace, str | os.PathLike[str]], Path]
    write_png: Callable[[Trace, str | os.PathLike[str]], Path]
    replay: Callable[[Trace], Trace]


_readers: TraceReaders | None = None


def attach_readers(readers: TraceReaders) -> None:
    """Give the `Trace` methods their readers (`roundpipe.sched.__init__` does, once)."""
    global _readers
    _readers = readers


def _attached() -> TraceReaders:
    if _readers is None:  # only while roundpipe.sched itself is still loading
        raise RuntimeError("the trace readers are attached once roundpipe.sched has loaded")
    return _readers


@dataclass(frozen=True)
class BubbleReport:
    """Idle time over the span of the compute lanes: per device and overall."""

    per_device: dict[int, float]
    overall: float
    makespan_ms: float
    busy_ms: dict[int, float]

    def __float__(self) -> float:
        return self.overall


class Trace:
    """Finished tasks, in completion order. Iterate it, index it, or ask it questions."""

    def __init__(self, records: list[Task] | None = None, meta: dict[str, Any] | None = None) -> None:
        self.records: list[Task] = records if records is not None else []
        self.meta: dict[str, Any] = dict(meta or {})

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.records)

    def __getitem__(self, index: int) -> Task:
        return self.records[index]

    def clear(self) -> None:
        self.records.clear()

    def lanes(self) -> list[str]:
        return sorted({t.lane for t in self.records})

    def order(self) -> dict[str, list[tuple[Any, ...]]]:
        """Per lane, the task keys in the order they started (what `replay` must reproduce)."""
        per_lane: dict[str, list[Task]] = {}
        for task in self.records:
            per_lane.setdefault(task.lane, []).append(task)
        return {
            lane: [t.key for t in sorted(tasks, key=lambda t: (t.start_t, t.seq))]
            for lane, tasks in per_lane.items()
        }

    # ------------------------------------------------------------------ metrics

    def makespan_ms(self) -> float:
        if not self.records:
            return 0.0
        return max(t.end_t for t in self.records) - min(t.start_t for t in self.records)

    def bubble_ratio(self, *, start_ms: float | None = None, end_ms: float | None = None) -> BubbleReport:
        """Idle fraction of each device's compute lane over the window [start_ms, end_ms]
        (default: from the first to the last compute task of the whole trace, the same window
        for every device, so fill and drain count as bubble)."""
        computes = [t for t in self.records if t.kind in COMPUTE_KINDS]
        if not computes:
            return BubbleReport({}, 0.0, 0.0, {})
        lo = min(t.start_t for t in computes) if start_ms is None else start_ms
        hi = max(t.end_t for t in computes) if end_ms is None else end_ms
        span = max(hi - lo, 1e-12)
        busy: dict[int, float] = {}
        for task in computes:
            overlap = min(task.end_t, hi) - max(task.start_t, lo)
            if overlap > 0:
                busy[task.device] = busy.get(task.device, 0.0) + overlap
        devices = sorted({t.device for t in computes})
        # Clamped: summing float durations can overshoot the span by an ulp (a bubble of -2e-16).
        per_device = {d: min(1.0, max(0.0, 1.0 - busy.get(d, 0.0) / span)) for d in devices}
        overall = sum(per_device.values()) / len(per_device)
        return BubbleReport(per_device, overall, hi - lo, {d: busy.get(d, 0.0) for d in devices})

    def check_rules(self) -> None:
        """Raise `RuleViolation` naming the rule and the tasks if any of the five rules is broken."""
        _attached().check_rules(self)

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "meta": self.meta, "tasks": [t.to_dict() for t in self.records]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """The inverse of `to_dict`; anything else raises `ValueError` saying what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(
                f"not a roundpipe trace (a JSON {_json_type(data)}, expected an object with "
                f'"format": {TRACE_FORMAT!r})'
            )
        if data.get("format") != TRACE_FORMAT:
            raise ValueError(
                f"not a roundpipe trace (format {data.get('format')!r}, expected {TRACE_FORMAT!r})"
            )
        tasks, meta = data.get("tasks"), data.get("meta", {})
        if not isinstance(tasks, list):
            raise ValueError(
                f'not a roundpipe trace ("tasks" is a JSON {_json_type(tasks)}, expected an array)'
            )
        if not isinstance(meta, dict):
            raise ValueError(
                f'not a roundpipe trace ("meta" is a JSON {_json_type(meta)}, expected an object)'
            )
        records = []
        for i, d in enumerate(tasks):
            try:
                records.append(Task.from_dict(d))
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise ValueError(f"not a roundpipe trace (task record {i} is malformed: {exc!r})") from exc
        return cls(records, meta)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace as JSON, atomically (temp file + rename); gzipped when ``path`` ends in
        ``.gz`` (a long GPU run's trace is tens of MB)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        os.close(fd)
        with _open_text(tmp, "w", gzipped=path.suffix == ".gz") as f:
            json.dump(self.to_dict(), f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace `save` wrote (gzipped when ``path`` ends in ``.gz``)."""
        with _open_text(path, "r", gzipped=Path(path).suffix == ".gz") as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ views

    def to_perfetto(self, path: str | os.PathLike[str]) -> Path:
        """Chrome/Perfetto trace-event JSON: one track per lane per device (open in ui.perfetto.dev)."""
        return _attached().write_perfetto(self, path)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """A PNG timeline: one row per lane, coloured by kind (needs matplotlib)."""
        return _attached().write_png(self, path)

    def replay(self) -> Trace:
        """Re-run the recorded task graph on the fake backend with the recorded durations."""
        return _attached().replay(self)

    def summary(self) -> str:
        report = self.bubble_ratio()
        per_device = ", ".join(f"d{d} {b:.1%}" for d, b in report.per_device.items())
        return f"{len(self)} tasks, makespan {report.makespan_ms:.2f} ms, bubble {report.overall:.2%}" + (
            f" ({per_device})" if per_device else ""
        )


def _open_text(path: str | os.PathLike[str], mode: str, *, gzipped: bool) -> IO[str]:
    if gzipped:
        return cast(IO[str], gzip.open(path, mode + "t", encoding="utf-8"))
    return open(path, mode, encoding="utf-8")
