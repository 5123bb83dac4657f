"""The scheduling engine: tasks, lanes, the five rules and traces.

Public names: `Task`, `Engine`, `Trace`, `GraphBuilder`, `ModelSpec`, `ScheduleOptions`,
`RuleViolation`, and `simulate`, `replay`, `SimulationResult`. The last three live in
`roundpipe.simulate`, above both this package and the backends (simulation joins the engine to the
fake backend, which builds on this package); they are forwarded here on first access so that
``roundpipe.sched.simulate(...)`` keeps working without this package ever importing upward.
"""

from __future__ import annotations

from typing import Any

from roundpipe.sched.engine import Engine
from roundpipe.sched.graph import GraphBuilder, IterationGraph, ModelSpec, ScheduleOptions
from roundpipe.sched.rules import RuleViolation
from roundpipe.sched.task import Task
from roundpipe.sched.trace import BubbleReport, Trace
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


def __getattr__(name: str) -> Any:
    # Deferred, so the module-level import graph keeps sched below roundpipe.simulate.
    if name in _FROM_SIMULATE:
        import roundpipe.simulate

        return getattr(roundpipe.simulate, name)
    raise AttributeError(f"module 'roundpipe.sched' has no attribute {name!r}")
