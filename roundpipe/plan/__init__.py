"""Planning: layer costs, the stage partition, round-robin dispatch and the bubble formula.

Pure functions and immutable values over plain numbers, so the planner can run anywhere (CLI,
tests, the scheduler) in microseconds. Nothing here may import anything but the standard library
and `roundpipe.errors`: no torch, no asyncio, no backend, no other part of roundpipe
(tests/test_layering.py checks the imports, and that the package loads where torch is absent).
"""

from roundpipe.plan.choose import choose_plan
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import SlotRun, analytic_bubble, dispatch, steady_iteration_ms
from roundpipe.plan.partition import Plan, Slot, SlotKind, objective, partition
from roundpipe.plan.rounds import round_sizes

__all__ = [
    "LayerCosts",
    "Plan",
    "Slot",
    "SlotKind",
    "SlotRun",
    "analytic_bubble",
    "choose_plan",
    "dispatch",
    "objective",
    "partition",
    "round_sizes",
    "steady_iteration_ms",
]
