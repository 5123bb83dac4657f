"""Refinement: after the ranking's choice is timed, time the plans next to the best ones.

Why a module of its own: the ranking models order candidates well on most shapes and miss by a
few percent on some (`_refine` says where); timing is exact, so timing the neighbours of the best
can only shorten the chosen iteration, at the price of planning time. This module decides which
neighbours; `roundpipe.plan.choose` decides when. It must never time a plan the timer has spared
(`_Timer`), so the choice stays the least time of what was timed.
"""

from __future__ import annotations

from collections.abc import Iterable

from roundpipe.plan import _candidates
from roundpipe.plan._ranking import _Candidate, _rank, _stages, _StageTimes
from roundpipe.plan._timer import _Timer
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import Plan

REFINE_TIMED = 4
"""`_refine` times this many of each start's neighbours, the best by the ranking model: each
timing costs a millisecond or two at 94 layers (the compiled replay), the model a tenth of that."""


REFINE_LATE_TIMED = 1
"""Around a plan of up to N slots, a loop one loss late (``late``) also times this many of the
neighbours best by its own model (`_ranking.LATE_MODEL_WINDOW`), which reads those plans within a
few percent where the waiting loop's model (the REFINE_TIMED above) is 20-30% slow and misorders
them: at 94 layers, backward 2.5x, head 1x, the fastest even plan (6 slots, a fused stage one
layer longer than the choice's; 814.0 ms) was 7th of the neighbours by that model and 3rd by
its own, and the choice 2.2% slower. Three with the model's shorter window (iterations 3 to 7 of
8): against every even plan, on the (8, 16) grid shapes of 24 to 94 layers, 8 choices faster,
none slower, for 99 -> 105 timings over the 16 grid shapes at 94 layers. With the longer window
(3 to 9 of 10) and three few-slot plans timed by that model (`LATE_MODELLED`), one gives the
same choices as three on the 288 late-loop grid shapes ((8, 16), (4, 8) and (2, 4); 24-94
layers) for fewer timings (20 fewer over the 48 (8, 16) shapes of 24-32 layers, 3-7 over the 16
of each of 48, 64 and 94 layers); none, 21 fewer at 24-32 layers, but a 28- and a 32-layer
shape 0.05% and 0.8% slower."""

OTHER_KIND_WITHIN = 1.05
"""`_refine` looks around the best plan of the other kind only when it is within this of the best."""


def _refine(
    timer: _Timer,
    wider: list[Plan],
    chains: _candidates.EvenChains,
    costs: LayerCosts,
    rounds: tuple[int, ...],
    async_optimizer: bool,
    loop: bool,
    late: bool = False,
) -> None:
    """Time the plans next to the best timed ones (with ``timer``).

    The ranking model orders candidates well enough to time the right few on most shapes, but on
    some it misses by up to 8% (the late loop's 24-32 layer grid shapes: the fastest plan a
    12-slot one the model put below 4-slot ones, or the same slots and fused stage with one more
    forward stage than the plan it modelled best). Timing is exact, so timing more plans can only
    shorten the chosen iteration; what it costs is planning time. In order: the best wider plan
    (`_ranked_candidates`: timed before only when modelled first of all); the other even plans of
    the best timed plan's slot count and fused stage and of the wider plan's (other
    forward/backward stage counts: a handful); then, around the best so far and around the best
    of the other kind (up to N slots, whose rounds run side by side, or more than N: the fastest
    plans fall in two such groups, and the ranking can leave the better group's best untimed),
    the even plans with a slot count and a fused start within one of it, the `REFINE_TIMED` best
    by the ranking model (the loop's model for plans of up to N slots when ``loop``), and around
    a plan of up to N slots for a loop one loss late (``late``) the `REFINE_LATE_TIMED` best by
    that loop's own model."""
    num_devices = next(iter(timer.timed.values()))[1].num_devices
    evens = _Evens(chains, _StageTimes(costs), num_devices, sum(rounds))
    for plan in wider:
        timer.time(plan)
    for plan in [_best(timer.timed.values()), *wider]:
        for candidate in evens.of(plan.num_slots, plan.fused.start):
            timer.time(candidate.plan())
    for around in _starts(timer, num_devices):
        near = evens.near(around, timer)
        few = async_optimizer and loop and around.num_slots <= num_devices
        ranking = (evens.times, num_devices, rounds)
        _time_best(timer, near, REFINE_TIMED, *ranking, async_optimizer, loop=few)
        if few and late and REFINE_LATE_TIMED:  # and by the late loop's own model
            _time_best(timer, near, REFINE_LATE_TIMED, *ranking, True, loop=True, late=True)


def _best(plans: Iterable[tuple[float, Plan]]) -> Plan:
    return min(plans, key=lambda timed_plan: timed_plan[0])[1]


def _starts(timer: _Timer, num_devices: int) -> list[Plan]:
    """The plans `_refine` looks around: the best timed, and the best of the other kind (up to N
    slots or more than N) where that is within OTHER_KIND_WITHIN of it."""
    timed = timer.timed
    first = _best(timed.values())
    wide = first.num_slots > num_devices
    first_ms = timed[_stages(first)][0]
    other_kind = [
        x
        for x in timed.values()
        if (x[1].num_slots > num_devices) != wide and x[0] <= first_ms * OTHER_KIND_WITHIN
    ]
    return [first, *([_best(other_kind)] if other_kind else [])]


class _Evens:
    """The even plans of a slot count and fused start (`_candidates.EvenChains.plans`), as
    candidates the ranking models."""

    def __init__(self, chains: _candidates.EvenChains, times: _StageTimes, num_devices: int, m: int) -> None:
        self.chains, self.times, self.num_devices, self.m = chains, times, num_devices, m

    def of(self, s_count: int, fused_start: int) -> list[_Candidate]:
        if not self.chains.ticks.p_mem <= fused_start < self.chains.ticks.n or s_count < 1:
            return []
        plans = self.chains.plans(s_count, fused_start)
        keys = [(tuple(f), fused, tuple(b)) for _, (f, fused, b) in plans]
        return [_Candidate(None, key, self.times.of(*key), self.num_devices, self.m) for key in keys]

    def near(self, around: Plan, timer: _Timer) -> dict[object, _Candidate]:
        """The even plans with a slot count and a fused start within one of ``around``'s, neither
        timed nor spared by ``timer``."""
        near: dict[object, _Candidate] = {}
        for s_count in (around.num_slots, around.num_slots - 1, around.num_slots + 1):
            for fused_start in (around.fused.start, around.fused.start - 1, around.fused.start + 1):
                for candidate in self.of(s_count, fused_start):
                    key = (candidate.fwd_stages, candidate.fused, candidate.bwd_stages)
                    if key not in timer.timed and key not in timer.spared:
                        near.setdefault(key, candidate)
        return near


def _time_best(
    timer: _Timer,
    near: dict[object, _Candidate],
    keep: int,
    times: _StageTimes,
    num_devices: int,
    rounds: tuple[int, ...],
    async_optimizer: bool,
    *,
    loop: bool,
    late: bool = False,
) -> None:
    """Time the best ``keep`` of ``near`` by the ranking model (`_rank`'s ``loop`` and ``late``)."""
    modelled = _rank(
        list(near.values()),
        num_devices,
        rounds,
        async_optimizer,
        keep=keep,
        times=times,
        loop=loop,
        late=late,
    )
    for _, plan in modelled[:keep]:
        timer.time(plan)
