"""The scheduling engine: tasks, lanes, the five rules, traces and simulation.

Public names: `Task`, `Engine`, `Trace`, `GraphBuilder`, `ModelSpec`, `ScheduleOptions`,
`simulate`, `replay`, `RuleViolation`.
"""

from roundpipe.sched.engine import Engine, EngineStatistics
from roundpipe.sched.graph import GraphBuilder, IterationGraph, ModelSpec, ScheduleOptions
from roundpipe.sched.rules import RuleViolation
from roundpipe.sched.simulate import SimulationResult, replay, simulate
from roundpipe.sched.task import Task
from roundpipe.sched.trace import BubbleReport, Trace

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
