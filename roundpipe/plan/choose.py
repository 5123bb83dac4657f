"""Which plan a run uses: one entry point for the pipe, the CLI and the benchmarks.

`partition` answers two precise questions: the exact optimum of the t_max objective (fast, any
size), and with ``steady=True`` the best plan under the steady-state model of async round-robin
dispatch. Both are proxies: several plans share a t_max optimum and round-robin stalls on uneven
ones, and the steady model can be wrong on shapes it was not checked on. So when the caller gives
an ``evaluate`` function (ms per iteration of a plan, e.g. `roundpipe.plan_eval.engine_evaluator`:
the real engine on the fake backend), `choose_plan` generates candidates around the proxies' plans
(slot counts and fused stages nearby, chains cut evenly), ranks them with a fast model of the
stream (`_ranking`: `_split_stream.split_ms` for sync runs, `_stream.stream_ms` for async),
evaluates the best few exactly and runs the fastest; equal times go to the more even plan.
Without ``evaluate`` it keeps the proxies' choice.

Pure: no torch, no devices, no scheduler (the evaluator is passed in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from roundpipe.plan import _candidates, _search, _stream
from roundpipe.plan._collector import collections_paused
from roundpipe.plan._ranking import _Candidate, _rank, _stages, _StageTimes, spread
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import round_sizes, steady_iteration_ms
from roundpipe.plan.partition import Plan, partition

STEADY_SEARCH_MAX_LAYERS = 256
"""Above this the steady-state search costs more than a second; the t_max objective decides."""

EVALUATE_MAX_LAYERS = 256
"""Above this `choose_plan` does not evaluate (each evaluation runs thousands of tasks); the
proxies decide."""

SLOT_REACH, FUSED_REACH = 2, 3
"""Candidates: slot counts within SLOT_REACH of a proxy's plan, fused stages starting within
FUSED_REACH layers of its fused stage."""


def many_slots(num_devices: int, num_microbatches: int) -> int:
    """Sync candidates reach up to this many slots (even plans, the fused stage about the mean
    slot), beyond the proxies' neighbourhood: 10N, and at most 800 computes per iteration (S * M).

    Why: a sync iteration's fill and drain cost N(N-1) slot times against M * S of work, so more,
    shorter slots waste less until the layers run out or the slots grow uneven; the t_max
    objective stops short of that (the fastest even plans at (8, 16) have 24-37 slots on 24-32
    layers, 46-83 on 48-64). The caps are what planning time allows: with them every sync choice
    of 24-64 layers is within 2% of the fastest even plan (`python bench/schedule.py --exhaustive
    --modes sync --layers 24 28 32 48 64 --devices 8 4`); at 1024 computes 5 of the 16 94-layer
    grid shapes take 50-67 ms to plan, past the 50 ms target (docs/performance.md)."""
    return min(10 * num_devices, 800 // max(num_microbatches, 1))


FINEST_FUSED_LAYERS = 2
"""Sync candidates also take the finest plans (`_candidates.finest`: one layer per backward stage,
the fewest forward stages no slower), with fused stages of the last 1 to this many layers (0:
none). At 94 layers on (8, 16) the fastest sync plans have 100-125 slots, twice what the t_max
objective and `many_slots` reach; with these 16 of the 16 grid shapes are within 2% of the
fastest even plan, some faster than any (their forward stage count is not the even split's), at
no measurable planning cost (`python bench/schedule.py --exhaustive --modes sync --layers 94`)."""


SYNC_LONGER_FUSED = 4
"""Sync candidates of up to 2N slots (`_ranked_candidates`' few-slot and wider plans) also take
fused stages starting up to this many layers before the one about the mean slot: a fused stage
recomputes nothing, and on sync runs a longer one saves more than its imbalance costs. At (4, 8)
the fastest plans of the grid shapes of 24-48 layers have 6 slots, one forward stage and a fused
stage 2-4 layers longer than that (48L backward 1.3x head 4x: a 12-layer fused stage, 1.06%
faster than the 23-slot plan found without the reach). 8 and 16 find nothing more and cost 5-13
ms; 4 costs 2-9% of sync planning at 94 layers on the H200 host (`python bench/planning_ab.py
--loops sync --devices 8` and `4`)."""

LATE_FEW_TIMED = 2
"""A loop one loss late (``choose_plan(..., late=True)``): the plans of up to N slots best in the
chained ranking, this many, are timed too; few slots make small graphs, cheap to time."""

LATE_MODELLED = 3
"""And this many of the plans of up to N slots best by the model of a loop one loss late
(`_ranking.LATE_MODEL_ITERATIONS`: each iteration gated on the losses of the one two back, over
a longer window): those plans settle late in such a loop and both other models read them 20-45%
slow. That model ranks the fastest of them in its best three on 38 of the 48 (8, 16) grid shapes
of 24-32 layers. Added to the chained ranking's few, not replacing them: replacing them lost as
many shapes as it found (`python bench/schedule.py --exhaustive --loss-lag 1`)."""

LATE_EQUAL_TIMED, EQUAL_SPLIT_REACH = 1, 4
"""And the best of the plans of up to N slots whose forward stages all hold one number of layers
and backward stages another (`_candidates.equal_splits`, fused stages within EQUAL_SPLIT_REACH
layers of the mean slot's), by that model, where the families above do not hold them: every
round of such a plan repeats exactly. On the 24-layer grid shape of backward 1.3x and head 3x
the fastest even plan is one (7 slots: two forward stages of 10 layers, a fused stage from layer
20, four backward stages of 5), outside every other family. A reach of 8 finds nothing more for
more planning; 2 misses that plan."""

SHORTLISTED = 5
"""With an evaluator that estimates (`roundpipe.plan_eval`'s loop evaluators: `_Timer.consider`),
the waiting loop looks at the best this many by the ranking, not only the `default_evaluations`
few it times in full. The ranking models four iterations and misses the settled order by a few
percent on some shapes; the evaluation's short run is exact on most plans (it has settled) and
costs a fraction of a full evaluation on all. 6 finds no more on the 24-32 layer grid shapes at
(8, 16); 4 finds less."""

SHORTLIST_COMPUTES = 2400
"""The shortlist is longer where plans are small: as many plans as this many computes make
(`shortlisted`), at least SHORTLISTED. What an estimate costs grows with the computes of the
plan's short run (S * M per iteration), so small plans can be looked at in greater number for
the same time. At (4, 8) the ranking is about 6% off on the mean and puts the fastest plan of
some shapes 7th; 8-12 listed there keep every (4, 8) choice of 24-32 layers within 2% of the
fastest even plan for 0-2 ms more at 94 layers; at (8, 16) it stays 5 or 6."""

DEALT_LISTED = 1
"""The waiting loop's shortlist also takes the best this many of the plans with 2N backward
stages beyond 2N slots (`_candidates.dealt_backward`), by the loop's model, where the model puts
them among the shortlist. No other family holds those plans, and on small models (24 layers on
8 devices) they are the fastest of some shapes by 1.7-3.9%; 2 or 3 find no more."""

RECHECKED, RECHECK_LISTED = 15, 2
"""The waiting loop's shortlist also takes the best ``RECHECK_LISTED`` of the ranking's next
plans, up to the ``RECHECKED``-th, by the loop's model over a longer window
(`_ranking.LONG_LOOP_MODEL_WINDOW`). The ranking's window starts at the first iteration after
the fill, which on some plans still runs slow: on the (8, 16) grid shape of 32 layers, backward
3.8x and head 4x the fastest even plan (11 slots) is 11th by it. Added to the shortlist, not
re-ordering it: re-ordering by the longer window made other grid shapes up to 2.6% longer. 11 to
14 would do for that shape; 15 leaves a margin."""

WIDER_LISTED = 3
"""The waiting loop's shortlist also takes the best this many of the wider plans (N+1 to 2N slots,
the fused stage about the mean slot), by the loop's model, those it puts no slower than the
shortlist's last (as `DEALT_LISTED`). `_ranked_candidates` ranks those plans apart by the chained
model and times the best only when it comes first of all; the chained model puts the fastest
plan of 48 layers, backward 1.3x, head 4x at (8, 16) 13th of 47, the loop's model 5th (both read
it 5% slow: they run a backward stage's recompute after the gradient, the engine ahead of it).
About 2.6 ms more a shape at 94 layers; 2 listed find half of what 3 find."""

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


ASYNC_EVALUATED_ITERATIONS = 6
"""What one async evaluation runs (`roundpipe.plan_eval`: a chained run of 6); sizes the budget."""

Evaluate = Callable[[Plan], float]


def choose_plan(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    mem_limit_bytes: int | None = None,
    *,
    async_optimizer: bool = False,
    round_size: int | None = None,
    evaluate: Evaluate | None = None,
    evaluations: int | None = None,
    loop: bool = True,
    late: bool = False,
    refine: bool | None = None,
) -> Plan:
    """The plan to run.

    Without ``evaluate``: `partition`'s objective optimum, or for an async run the better of it and
    the steady-state plan by `steady_iteration_ms` (ties keep the objective optimum). With
    ``evaluate`` (ms per iteration of a plan): the least evaluated time among the proxies' choice
    and the best-modelled candidates, ``evaluations`` plans in all (at least 2; default by size,
    see `default_evaluations`); up to EVALUATE_MAX_LAYERS layers, beyond which the proxies decide.
    ``loop`` (async): the evaluator times iterations as a training loop submits them, each once
    the previous one's losses are in (`roundpipe.plan_eval.engine_evaluator`'s default), and the
    plans of up to N slots, whose rounds run side by side and which a loop cannot lend an
    iteration's idle devices, have their best by the loop's model timed too (`_ranked_candidates`);
    ``loop=False`` for an evaluator that times chained runs. ``late`` (async, with ``loop``): the
    loop reads each loss one iteration late (`roundpipe.plan_eval.late_loop_evaluator`), which on
    most plans submits as a chained run does, so the best two of those few-slot plans by the
    chained model are timed as well, and the best two by a model of its own submission
    (`LATE_MODELLED`). ``refine``: then the plans next to the best timed ones
    (`_refine`); by default for the late loop only, whose ranking is the least exact (the chained
    model, for a loop that runs each plan the better of two ways). Elsewhere it finds less than it
    costs: sync, 8 of the grid's 288 shapes shorter, by at most 2.1%; the
    waiting async loop, 58 of 288, 0.3% on the mean, for about 15 ms more at 94 layers (half
    again), against a 50 ms target (docs/performance.md). An ``evaluate`` with a ``floor(plan)``
    method, a lower bound of its figure (`roundpipe.plan_eval`'s loop evaluators), spares the
    plans whose floor is past the best time so far (`_Timer`): the same choice, fewer timings.
    An ``evaluate`` that also has an ``estimate(plan)`` method (the loop evaluators: the figure of
    the evaluation's short run, and whether that is its figure) lets the loop waiting for each
    loss look past its few at a shortlist of the ranking's next best (SHORTLISTED): each taken at
    its estimate where that is exact, timed in full where it promises to be faster
    (`_Timer.consider`); with it, the best plan of 2N backward stages (`DEALT_LISTED`), the best
    three wider plans by the loop's model (`WIDER_LISTED`) and the best two of the ranking's next
    plans over a longer window (`RECHECKED`); small plans are timed wherever their estimate is
    under the best (`ESTIMATE_SMALL_COMPUTES`). An explicit ``evaluations`` turns the shortlist
    off.
    """
    with collections_paused():  # planning's objects are freed by reference counting (`_collector`)
        return _choose(
            costs,
            num_devices,
            num_microbatches,
            mem_limit_bytes,
            async_optimizer,
            round_size,
            evaluate,
            evaluations,
            loop,
            late,
            refine,
        )


def _choose(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    mem_limit_bytes: int | None,
    async_optimizer: bool,
    round_size: int | None,
    evaluate: Evaluate | None,
    evaluations: int | None,
    loop: bool,
    late: bool,
    refine: bool | None,
) -> Plan:
    """`choose_plan`'s work."""
    base = partition(costs, num_devices, num_microbatches, mem_limit_bytes, async_optimizer=async_optimizer)
    proxies = [base]
    if costs.num_layers > max(STEADY_SEARCH_MAX_LAYERS, EVALUATE_MAX_LAYERS):
        return base  # neither the steady search nor an evaluation
    chains = _even_chains(costs, mem_limit_bytes)  # one cache of splits for both
    if async_optimizer and costs.num_layers <= STEADY_SEARCH_MAX_LAYERS:
        steady = _steady_plan(chains, base, num_microbatches, round_size, costs)
        if steady != base:
            period = steady_iteration_ms(base, num_microbatches, num_devices, round_size=round_size)
            steady_period = steady_iteration_ms(steady, num_microbatches, num_devices, round_size=round_size)
            proxies = [steady, base] if steady_period < period else [base, steady]
    if evaluate is None or costs.num_layers > EVALUATE_MAX_LAYERS:
        return proxies[0]
    iterations = ASYNC_EVALUATED_ITERATIONS if async_optimizer else 1
    count = (
        default_evaluations(proxies[0], num_microbatches, iterations) if evaluations is None else evaluations
    )
    rounds = round_sizes(num_microbatches, num_devices, round_size)
    timer = _Timer(evaluate)
    # The late loop has its refinement instead (`_refine`): looking at the shortlist first moved
    # its starting points and lost more than it found (44 of 48 within 2% against 45).
    shortlist = timer.estimate is not None and evaluations is None and not (late and loop)
    listed = max(count, shortlisted(proxies[0], num_microbatches, iterations)) if shortlist else count
    ranked, extra, few, also_listed = _ranked_candidates(
        costs,
        proxies,
        chains,
        rounds,
        async_optimizer,
        max(listed, 2),
        loop and async_optimizer,
        late=late and loop and async_optimizer,
        dealt=DEALT_LISTED if shortlist and async_optimizer and loop else 0,
        wider_listed=WIDER_LISTED if shortlist and async_optimizer and loop else 0,
    )
    # The proxies' choice always runs in the comparison: evaluation never does worse than it.
    chosen = {_stages(proxies[0]): proxies[0]}
    for _, plan in ranked:
        if len(chosen) >= max(count, 2):
            break
        chosen.setdefault(_stages(plan), plan)
    if extra and (not ranked or extra[0][0] < ranked[0][0]):
        chosen.setdefault(_stages(extra[0][1]), extra[0][1])  # see `_ranked_candidates`
    for _, plan in few:
        chosen.setdefault(_stages(plan), plan)
    # Best modelled first (by the least of its models' figures): the sooner the best time is known,
    # the more plans its floor spares (`_Timer`: a spared plan could not be chosen). The late
    # loop's first few by the chained model are its proxies' many-slot plans, the slowest to time
    # (11 ms of 60 at 94 layers), and most are slower than its few-slot best. On the 16 grid
    # shapes of 94 layers, the late loop's timings took 284-290 ms in all at (8, 16) against
    # 332-365 (33-35 against 65-67 at (4, 8)); the waiting loop's within noise (95-112 against
    # 89-98). The choices of 384 grid shape/loop/device cases stayed the same.
    modelled: dict[object, float] = {}
    for ms, plan in [*ranked, *extra, *few]:
        key = _stages(plan)
        modelled[key] = min(ms, modelled.get(key, math.inf))
    for _, plan in sorted(chosen.items(), key=lambda item: modelled.get(item[0], math.inf)):
        timer.time(plan)
    if shortlist:  # by the evaluation's short run
        rechecked = _recheck(ranked[listed:RECHECKED], costs, rounds) if async_optimizer and loop else []
        for _, plan in [*ranked[:listed], *also_listed, *rechecked]:
            timer.consider(plan)
    if (late and loop and async_optimizer) if refine is None else refine:
        _refine(timer, [p for _, p in extra], chains, costs, rounds, async_optimizer, loop, late and loop)
    timed = timer.timed
    best_ms = min(ms for ms, _ in timed.values())
    ties = [p for ms, p in timed.values() if ms <= best_ms * (1 + 1e-9)]
    return min(ties, key=lambda p: (spread(p), p.num_slots, -len(p.fused)))


def _recheck(
    ranked: list[tuple[float, Plan]], costs: LayerCosts, rounds: tuple[int, ...]
) -> list[tuple[float, Plan]]:
    """The best `RECHECK_LISTED` of ``ranked`` (plans a waiting loop's ranking put just past its
    shortlist) by the loop's model over the longer window (`RECHECKED`)."""
    if not ranked:
        return []
    n = ranked[0][1].num_devices
    candidates = [_Candidate(plan) for _, plan in ranked]
    return _rank(
        candidates,
        n,
        rounds,
        True,
        keep=RECHECK_LISTED,
        times=_StageTimes(costs),
        loop=True,
        longer=True,
    )[:RECHECK_LISTED]


class _Timer:
    """The plans `choose_plan` has timed, by stages. An evaluator with a ``floor(plan)`` method (a
    lower bound of its figure: `roundpipe.plan_eval`'s loop evaluators give the busiest device's
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
    n, m = chains.ticks.n, sum(rounds)
    timed, time = timer.timed, timer.time
    num_devices = next(iter(timed.values()))[1].num_devices
    times = _StageTimes(costs)

    def best(plans: Iterable[tuple[float, Plan]]) -> Plan:
        return min(plans, key=lambda timed_plan: timed_plan[0])[1]

    def even_candidates(s_count: int, fused_start: int) -> list[_Candidate]:
        if not chains.ticks.p_mem <= fused_start < n or s_count < 1:
            return []
        keys = [(tuple(f), fused, tuple(b)) for _, (f, fused, b) in chains.plans(s_count, fused_start)]
        return [_Candidate(None, key, times.of(*key), num_devices, m) for key in keys]

    for plan in wider:
        time(plan)
    for plan in [best(timed.values()), *wider]:
        for candidate in even_candidates(plan.num_slots, plan.fused.start):
            time(candidate.plan())
    first = best(timed.values())
    wide = first.num_slots > num_devices
    first_ms = timed[_stages(first)][0]
    other_kind = [
        x
        for x in timed.values()
        if (x[1].num_slots > num_devices) != wide and x[0] <= first_ms * OTHER_KIND_WITHIN
    ]
    for around in [first, *([best(other_kind)] if other_kind else [])]:
        near: dict[object, _Candidate] = {}
        for s_count in (around.num_slots, around.num_slots - 1, around.num_slots + 1):
            for fused_start in (around.fused.start, around.fused.start - 1, around.fused.start + 1):
                for candidate in even_candidates(s_count, fused_start):
                    key = (candidate.fwd_stages, candidate.fused, candidate.bwd_stages)
                    if key not in timed and key not in timer.spared:
                        near.setdefault(key, candidate)
        few = async_optimizer and loop and around.num_slots <= num_devices
        modelled = _rank(
            list(near.values()),
            num_devices,
            rounds,
            async_optimizer,
            keep=REFINE_TIMED,
            times=times,
            loop=few,
        )
        for _, plan in modelled[:REFINE_TIMED]:
            time(plan)
        if few and late and REFINE_LATE_TIMED:  # and by the late loop's own model
            own = _rank(
                list(near.values()),
                *(num_devices, rounds, True),
                keep=REFINE_LATE_TIMED,
                times=times,
                loop=True,
                late=True,
            )
            for _, plan in own[:REFINE_LATE_TIMED]:
                time(plan)


def shortlisted(plan: Plan, num_microbatches: int, iterations: int) -> int:
    """How many plans the waiting loop's shortlist looks at (`SHORTLISTED`, `SHORTLIST_COMPUTES`),
    by the size of the proxies' plan (S*M computes per iteration)."""
    computes = plan.num_slots * num_microbatches * iterations
    return max(SHORTLISTED, SHORTLIST_COMPUTES // max(computes, 1))


def default_evaluations(plan: Plan, num_microbatches: int, iterations: int) -> int:
    """How many plans the engine times (the proxies' choice and the best-modelled candidates):
    fewer as their runs grow (S*M computes per iteration), so that choosing stays short."""
    computes = plan.num_slots * num_microbatches * iterations
    return max(2, min(4, 1200 // max(computes, 1)))


def _even_chains(costs: LayerCosts, mem_limit_bytes: int | None) -> _candidates.EvenChains:
    """Even chains over ``costs`` (in ticks), each stage within the memory rule's cap."""
    fwd, fb = _search.to_ticks(costs.fwd_ms, costs.bwd_ms)
    cap = None if mem_limit_bytes is None else mem_limit_bytes // 2
    return _candidates.EvenChains(_search.Ticks(fwd, fb, costs.mem_bytes, cap))


def _steady_plan(
    chains: _candidates.EvenChains,
    base: Plan,
    num_microbatches: int,
    round_size: int | None,
    costs: LayerCosts,
) -> Plan:
    """``partition(..., steady=True)`` once ``partition`` has checked the arguments and given the
    async t_max plan (``base``: its fallback), with the splits shared with the candidates."""
    n = base.num_devices
    rounds = round_sizes(num_microbatches, n, round_size)
    if len(set(rounds)) == 1:
        rounds = rounds[:1]  # as partition: one round is already the period of the stream
    found = _candidates.steady_search(chains.ticks, n, rounds, chains)
    return base if found is None else Plan.from_stages(*found, costs, n, num_microbatches)


def _ranked_candidates(
    costs: LayerCosts,
    proxies: list[Plan],
    chains: _candidates.EvenChains,
    rounds: tuple[int, ...],
    async_optimizer: bool,
    needed: int,
    loop: bool = False,
    *,
    late: bool = False,
    dealt: int = 0,
    wider_listed: int = 0,
) -> tuple[
    list[tuple[float, Plan]], list[tuple[float, Plan]], list[tuple[float, Plan]], list[tuple[float, Plan]]
]:
    """Even plans around each proxy plan (and the proxies; sync, also those of more slots up to
    `many_slots`), best modelled first; apart, the best
    modelled of the even plans with N+1 to 2N slots and a fused stage about the mean slot;
    (``loop``, async) the best of the even plans of up to N slots by the model of a training
    loop's submission; and the best ``dealt`` of the plans with 2N backward stages beyond 2N
    slots (`_candidates.dealt_backward`) by that model too, those it puts no slower than the
    ``needed``-th of the first list (`DEALT_LISTED`), and with them the best ``wider_listed`` of
    the wider plans below by that model, on the same condition (`WIDER_LISTED`).

    Those wider plans (a 1-3 layer fused stage, stages a little shorter than with N slots) are the
    fastest on several grid shapes (up to 11% faster than the others), but the ranking model is
    off by up to 20% on async plans: ranked with the rest they displace, on other shapes, the plan
    the engine prefers. So the best of them is timed in addition, and only when the model puts it
    first of all. ``needed``: how many of the ranked plans the caller reads, best first.

    Why the third: the async ranking models a chained run (cheap to prune, and it orders the
    many-slot plans as the loop's evaluation does), but a plan of up to N slots runs its rounds
    side by side, and the idle devices a chained run lends to the next iteration a loop cannot
    lend, so the chained model ranks those plans against the rest by a time they do not run in.
    Among themselves they are ranked by the loop's model (`stream_ms` with ``gate``), and their
    best is timed in addition. On the 48 (8, 16) async grid shapes of 24-32 layers that brings the
    chosen plan within 0.19% of the fastest even plan on the mean (2.5% at most), against 4.0%
    (11.8%) with the chained ranking alone; ranking every candidate by the loop's model instead
    made 20 of 64 grid shapes slower, by up to 8.4% (docs/performance.md)."""
    n, m = proxies[0].num_devices, proxies[0].num_microbatches
    plans = {_stages(p): _Candidate(p) for p in proxies}
    around = (
        _candidates.neighbourhood(chains, proxy.num_slots, proxy.fused.start, SLOT_REACH, FUSED_REACH)
        for proxy in proxies
    )
    longer = 0 if async_optimizer else SYNC_LONGER_FUSED
    families = [*around, _candidates.balanced_fused(chains, range(1, n + 1), longer)]
    if not async_optimizer:  # and the sync plans of more slots than the proxies' (`many_slots`)
        top = max(p.num_slots for p in proxies) + SLOT_REACH
        families.append(_candidates.balanced_fused(chains, range(top + 1, many_slots(n, m) + 1)))
        families.append(_candidates.finest(chains, FINEST_FUSED_LAYERS))
    times = _StageTimes(costs)
    few: dict[object, _Candidate] = {}  # the plans of up to N slots
    for family in families:
        for _, stages in family:
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            if key not in plans:
                plans[key] = _Candidate(None, key, times.of(*key), n, m)
            if len(stages[0]) + 1 + len(stages[2]) <= n:
                few[key] = plans[key]

    def apart(
        family: Iterable[_candidates.EvenPlan], *seen: dict[object, _Candidate]
    ) -> dict[object, _Candidate]:
        """A family's plans not among ``plans`` nor ``seen``, to be ranked apart from them."""
        out: dict[object, _Candidate] = {}
        for _, stages in family:
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            if key not in plans and key not in out and all(key not in other for other in seen):
                out[key] = _Candidate(None, key, times.of(*key), n, m)
        return out

    wider = apart(_candidates.balanced_fused(chains, range(n + 1, 2 * n + 1), longer))
    # Sync bounds are meant as true lower bounds of the model, so that the first ``needed`` are
    # exact with ``keep=needed`` (they are not quite: see `_rank`'s shared bound); the async
    # window's time per iteration can fall under its bound (iterations overlap), so there the
    # margin of 4 stays.
    keep = 4 if async_optimizer else needed
    shapes: dict[object, _stream.Shape] = {}  # the stream model's task graphs, for every ranking here
    ranked = _rank(
        list(plans.values()),
        *(n, rounds, async_optimizer),
        keep=keep,
        reads=max(keep, needed),
        times=times,
        # Sync: the proxies first (a good plan, whose time then prunes the rest sooner: 3 of 40 ms
        # at 94 layers); the order changes what is pruned, not the first ``reads`` (see `_rank`).
        first=0 if async_optimizer else len(proxies),
        shapes=shapes,
        # A loop waiting for each loss: every candidate by the loop's model (the late loop runs
        # most plans as a chained run does, so its ranking stays chained).
        loop=loop and not late,
    )
    # With sync bounds (as above) a wider plan whose bound is past the best modelled plan above
    # could not be timed (see `choose_plan`), so it need not be modelled.
    cutoff = ranked[0][0] if ranked and not async_optimizer else math.inf
    extra = _rank(
        list(wider.values()), n, rounds, async_optimizer, keep=1, cutoff=cutoff, times=times, shapes=shapes
    )

    def best_in_loop(
        candidates: dict[object, _Candidate], keep: int, cutoff: float = math.inf, late: bool = False
    ) -> list[tuple[float, Plan]]:
        """The best ``keep`` of ``candidates`` by the model of a training loop's submission (one
        loss late with ``late``), none past ``cutoff``."""
        return _rank(
            list(candidates.values()),
            n,
            rounds,
            True,
            keep=keep,
            cutoff=cutoff,
            times=times,
            loop=True,
            late=late,
            shapes=shapes,
        )[:keep]

    few_best = best_in_loop(few, 1) if loop else []
    if late:  # a loop one loss late runs most plans as the chained model does (`choose_plan`):
        # the best few-slot plans of the chained ranking above (modelled there already)
        few_best += [timed for timed in ranked if timed[1].num_slots <= n][:LATE_FEW_TIMED]
        if LATE_MODELLED:  # and the best few by the model of a loop one loss late
            few_best += best_in_loop(few, LATE_MODELLED, late=True)
        if LATE_EQUAL_TIMED:  # and of the plans of equal stages, not among them
            equal = apart(_candidates.equal_splits(chains, range(1, n + 1), EQUAL_SPLIT_REACH), few)
            few_best += best_in_loop(equal, LATE_EQUAL_TIMED, late=True)
    also_listed: list[tuple[float, Plan]] = []
    if ranked:  # by the loop's model, as ``ranked``, and only where they would be listed
        listed_ms = ranked[min(len(ranked), needed) - 1][0]
        if dealt:
            others = apart(_candidates.dealt_backward(chains, n), wider)
            also_listed += best_in_loop(others, dealt, cutoff=listed_ms)
        if wider_listed:
            also_listed += best_in_loop(wider, wider_listed, cutoff=listed_ms)
    return ranked, extra[:1], few_best, also_listed


def every_even_plan(costs: LayerCosts, num_devices: int, num_microbatches: int) -> list[Plan]:
    """Exhaustive: every slot count and fused stage, each chain cut evenly (`EvenChains`); what
    `choose_plan`'s candidates are drawn from. For checking a choice against the best of all
    (tests, `bench/schedule.py --exhaustive`): about a thousand plans at 24 layers."""
    chains = _even_chains(costs, None)
    plans: dict[object, Plan] = {}
    for p in range(costs.num_layers):
        for s in range(1, 2 * p + 2):
            for _, stages in chains.plans(s, p):
                plan = Plan.from_stages(*stages, costs, num_devices, num_microbatches)
                plans[_stages(plan)] = plan
    return list(plans.values())


def even_plan(
    fwd: list[range],
    fused: range,
    bwd: list[range],
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
) -> Plan:
    """`Plan.from_stages` for the candidates' chains (valid by construction, no memory check), the
    same plan built without its second pass: slot times summed as `Plan.stage_ms` sums them."""
    times = _StageTimes(costs).of(tuple(fwd), fused, tuple(bwd))
    return Plan(tuple(fwd), fused, tuple(bwd), max(times), num_devices, num_microbatches, times)
