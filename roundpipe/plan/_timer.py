"""Timing candidate plans for `choose_plan`: what has been timed, and what need not be.

Why a module of its own: the choice is only as good as the plans it times, and timing is what
planning costs. `_Timer` keeps the figures by stages, spares the plans whose floor (a lower bound
of their time) is past the best so far, and takes a shortlisted plan at its estimate where that
is exact. It must never change a figure or an order: sparing a plan that could not be the least
is the whole of its effect on the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from roundpipe.plan._ranking import _stages
from roundpipe.plan.partition import Plan

Evaluate = Callable[[Plan], float]

ESTIMATE_MARGIN = -0.01
"""`_Timer.consider` times in full a plan whose short run has not settled only where its estimate
is this much under the best time so far (-1%: 1% faster). Such estimates fall within 3% of the
settled figure either way, so this trades a little reach for time: at 0 the choices are the same
on the 24-32 layer grid shapes, but one 94-layer grid shape (backward 3.8x, head 1x) plans in 56
ms against 44."""

ESTIMATE_SMALL_COMPUTES = 320
"""A plan of up to this many computes per iteration (S * M: 20 slots at M = 16) is timed in full
wherever its estimate is under the best time so far, ESTIMATE_MARGIN or not: such plans are
cheap to time (1-2 ms at 94 layers, replays of 20 iterations included), where a 23-25 slot plan
that has not settled takes 10-16 ms, and the margin is there for those. Timing small plans
wherever their estimate is within 1% *over* the best finds 0.02-0.09% on a few grid shapes but
costs the waiting loop's 94-layer planning about half again on the H200 host (`python
bench/planning_ab.py --loops async`), past the 50 ms target."""


def _estimate_margin(plan: Plan) -> float:
    """How far under the best time so far a plan's unsettled estimate must be for `_Timer.consider`
    to time it in full: 0 for small plans (`ESTIMATE_SMALL_COMPUTES`), else ESTIMATE_MARGIN."""
    small = plan.num_slots * plan.num_microbatches <= ESTIMATE_SMALL_COMPUTES
    return 0.0 if small else ESTIMATE_MARGIN


class _Timer:
    """The plans `choose_plan` has timed, by stages. An evaluator with a ``floor(plan)`` method (a
    lower bound of its figure: `roundpipe.planning.ranking`'s loop evaluators give the busiest device's
    time per iteration) spares the plans whose floor is already past the best time so far: their
    time could not be the least (nor tie with it), so what is chosen stays the same."""

    def __init__(self, evaluate: Evaluate) -> None:
        self.evaluate = evaluate
        self.floor: Callable[[Plan], float] | None = getattr(evaluate, "floor", None)
        self.estimate: Callable[[Plan], tuple[float, bool]] | None = getattr(evaluate, "estimate", None)
        self.timed: dict[tuple[tuple[range, ...], range, tuple[range, ...]], tuple[float, Plan]] = {}
        self.spared: set[tuple[tuple[range, ...], range, tuple[range, ...]]] = set()
        self.best_ms = math.inf

    def consider(self, plan: Plan) -> None:
        """A plan past the few timed in full (with an evaluator that estimates: ``estimate(plan)``,
        from the evaluation's short run): its estimate where that is its time, else timed in full
        only where the estimate is within ESTIMATE_MARGIN of the best time so far."""
        if self.estimate is None or not self._open(plan):
            return
        ms, exact = self.estimate(plan)
        if exact:
            self._record(plan, ms)
        elif ms <= self.best_ms * (1 + _estimate_margin(plan)):
            self._record(plan, self.evaluate(plan))

    def time(self, plan: Plan) -> None:
        if self._open(plan):
            self._record(plan, self.evaluate(plan))

    def _open(self, plan: Plan) -> bool:
        """Whether ``plan`` still wants a figure: not timed yet, and not spared (now or before)
        by its floor."""
        key = _stages(plan)
        if key in self.timed or key in self.spared:
            return False
        if self.floor is not None and self.floor(plan) > self.best_ms * (1 + 1e-9):
            self.spared.add(key)
            return False
        return True

    def _record(self, plan: Plan, ms: float) -> None:
        self.timed[_stages(plan)] = (ms, plan)
        self.best_ms = min(self.best_ms, ms)
