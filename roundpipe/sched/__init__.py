"""The scheduling engine: tasks, lanes, the five rules and traces.

Public names: `Task`, `Engine`, `Trace`, `GraphBuilder`, `ModelSpec`, `ScheduleOptions`,
`RuleViolation`, and `simulate`, `replay`, `SimulationResult`. The last three live in
`roundpipe.planning.simulate`, above both this package and the backends (simulation joins the engine to the
fake backend, which builds on this package); they are forwarded here on first access so that
``roundpipe.sched.simulate(...)`` keeps working without this package ever importing upward.

It also attaches the trace's readers (`roundpipe.sched.trace.TraceReaders`): `Trace` keeps the
data and the questions, and the modules that check, export and replay a trace import it, never
the reverse; this package, which loads before any of its modules, joins them.
"""

from __future__ import annotations

from typing import Any

from roundpipe.sched.engine import Engine
from roundpipe.sched.export import write_perfetto, write_png
from roundpipe.sched.graph import GraphBuilder, IterationGraph, ModelSpec, ScheduleOptions
from roundpipe.sched.rules import RuleViolation, check_trace
from roundpipe.sched.task import Task
from roundpipe.sched.trace import BubbleReport, Trace, TraceReaders, attach_readers
from roundpipe.sched.upkeep import EngineStatistics

_FROM_SIMULATE = frozenset({"SimulationResult", "replay", "simulate"})

__all__ = [
    "BubbleReport",
    "Engine",
    "EngineStatistics",
    "GraphBuilder",
    "IterationGraph",
    "ModelSpec",
    "RuleViolation",
    "ScheduleOptions",
    "SimulationResult",
    "Task",
    "Trace",
    "replay",
    "simulate",
]


def _replay(trace: Trace) -> Trace:
    """`Trace.replay`: `roundpipe.planning.simulate.replay`, reached as the forwarded names are."""
    import roundpipe.planning.simulate

    return roundpipe.planning.simulate.replay(trace)


attach_readers(TraceReaders(check_trace, write_perfetto, write_png, _replay))


def __getattr__(name: str) -> Any:
    # Deferred, so the module-level import graph keeps sched below roundpipe.planning.simulate.
    if name in _FROM_SIMULATE:
        import roundpipe.planning.simulate

        return getattr(roundpipe.planning.simulate, name)
    raise AttributeError(f"module 'roundpipe.sched' has no attribute {name!r}")
