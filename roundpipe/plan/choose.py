"""Which plan a run uses: one entry point for the pipe, the CLI and the benchmarks.

`partition` answers two precise questions: the exact optimum of the t_max objective (fast, any
size), and with ``steady=True`` the best plan under the steady-state model of async round-robin
dispatch. Both are proxies: several plans share a t_max optimum and round-robin stalls on uneven
ones, and the steady model can be wrong on shapes it was not checked on. So when the caller gives
an ``evaluate`` function (ms per iteration of a plan, e.g. `roundpipe.planning.ranking.engine_evaluator`:
the real engine on the fake backend), `choose_plan` generates candidates around the proxies' plans
(slot counts and fused stages nearby, chains cut evenly), ranks them with a fast model of the
stream (`_ranking`: `_split_stream.split_ms` for sync runs, `_stream.stream_ms` for async),
evaluates the best few exactly and runs the fastest; equal times go to the more even plan.
Without ``evaluate`` it keeps the proxies' choice.

Pure: no torch, no devices, no scheduler (the evaluator is passed in).
"""

from __future__ import annotations

import math

from roundpipe.plan import _candidates, _search, _steady_search
from roundpipe.plan._collector import collections_paused
from roundpipe.plan._families import _ranked_candidates
from roundpipe.plan._ranking import _Candidate, _rank, _stages, _StageTimes, spread
from roundpipe.plan._refine import _refine
from roundpipe.plan._timer import Evaluate, _Timer
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import round_sizes, steady_iteration_ms
from roundpipe.plan.partition import Plan, partition
from roundpipe.plan.shape import RunShape

STEADY_SEARCH_MAX_LAYERS = 256
"""Above this the steady-state search costs more than a second; the t_max objective decides."""

EVALUATE_MAX_LAYERS = 256
"""Above this `choose_plan` does not evaluate (each evaluation runs thousands of tasks); the
proxies decide."""

SHORTLISTED = 5
"""With an evaluator that estimates (`roundpipe.planning.ranking`'s loop evaluators: `_Timer.consider`),
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

ASYNC_EVALUATED_ITERATIONS = 6
"""What one async evaluation runs (`roundpipe.planning.ranking`: a chained run of 6); sizes the budget."""


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
    the previous one's losses are in (`roundpipe.planning.ranking.engine_evaluator`'s default), and the
    plans of up to N slots, whose rounds run side by side and which a loop cannot lend an
    iteration's idle devices, have their best by the loop's model timed too (`_ranked_candidates`);
    ``loop=False`` for an evaluator that times chained runs. ``late`` (async, with ``loop``): the
    loop reads each loss one iteration late (`roundpipe.planning.ranking.late_loop_evaluator`), which on
    most plans submits as a chained run does, so the best two of those few-slot plans by the
    chained model are timed as well, and the best two by a model of its own submission
    (`LATE_MODELLED`). ``refine``: then the plans next to the best timed ones
    (`_refine`); by default for the late loop only, whose ranking is the least exact (the chained
    model, for a loop that runs each plan the better of two ways). Elsewhere it finds less than it
    costs: sync, 8 of the grid's 288 shapes shorter, by at most 2.1%; the
    waiting async loop, 58 of 288, 0.3% on the mean, for about 15 ms more at 94 layers (half
    again), against a 50 ms target (docs/performance.md). An ``evaluate`` with a ``floor(plan)``
    method, a lower bound of its figure (`roundpipe.planning.ranking`'s loop evaluators), spares the
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
        shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size)
        return _choose(costs, shape, mem_limit_bytes, evaluate, evaluations, loop, late, refine)


def _choose(
    costs: LayerCosts,
    shape: RunShape,
    mem_limit_bytes: int | None,
    evaluate: Evaluate | None,
    evaluations: int | None,
    loop: bool,
    late: bool,
    refine: bool | None,
) -> Plan:
    """`choose_plan`'s work."""
    proxies, chains = _proxies(costs, shape, mem_limit_bytes)
    if chains is None or evaluate is None or costs.num_layers > EVALUATE_MAX_LAYERS:
        return proxies[0]
    num_microbatches, async_optimizer = shape.num_microbatches, shape.async_optimizer
    iterations = ASYNC_EVALUATED_ITERATIONS if async_optimizer else 1
    count = (
        default_evaluations(proxies[0], num_microbatches, iterations) if evaluations is None else evaluations
    )
    rounds = shape.rounds()
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
    for plan in _first_timed(proxies[0], ranked, extra, few, count):
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


def _proxies(
    costs: LayerCosts, shape: RunShape, mem_limit_bytes: int | None
) -> tuple[list[Plan], _candidates.EvenChains | None]:
    """The proxies' plans, their choice first: `partition`'s, and for an async run the steady
    search's (the one of the lesser `steady_iteration_ms` first; ties keep `partition`'s); and the
    even chains both searches share, None past every search's size (the proxies decide)."""
    num_devices, num_microbatches = shape.num_devices, shape.num_microbatches
    async_optimizer, round_size = shape.async_optimizer, shape.round_size
    base = partition(costs, num_devices, num_microbatches, mem_limit_bytes, async_optimizer=async_optimizer)
    if costs.num_layers > max(STEADY_SEARCH_MAX_LAYERS, EVALUATE_MAX_LAYERS):
        return [base], None  # neither the steady search nor an evaluation
    chains = _even_chains(costs, mem_limit_bytes)  # one cache of splits for both
    if async_optimizer and costs.num_layers <= STEADY_SEARCH_MAX_LAYERS:
        steady = _steady_plan(chains, base, num_microbatches, round_size, costs)
        if steady != base:
            period = steady_iteration_ms(base, num_microbatches, num_devices, round_size=round_size)
            steady_period = steady_iteration_ms(steady, num_microbatches, num_devices, round_size=round_size)
            return ([steady, base] if steady_period < period else [base, steady]), chains
    return [base], chains


def _first_timed(
    proxy: Plan,
    ranked: list[tuple[float, Plan]],
    extra: list[tuple[float, Plan]],
    few: list[tuple[float, Plan]],
    count: int,
) -> list[Plan]:
    """The plans timed in full before any shortlist: the proxies' choice (evaluation never does
    worse than it), the best ``count`` ranked (at least 2), the best wider plan where it is
    modelled first of all (see `_ranked_candidates`) and the best few-slot plans.

    Best modelled first (by the least of its models' figures): the sooner the best time is known,
    the more plans its floor spares (`_Timer`: a spared plan could not be chosen). The late loop's
    first few by the chained model are its proxies' many-slot plans, the slowest to time (11 ms of
    60 at 94 layers), and most are slower than its few-slot best. On the 16 grid shapes of 94
    layers, the late loop's timings took 284-290 ms in all at (8, 16) against 332-365 (33-35
    against 65-67 at (4, 8)); the waiting loop's within noise (95-112 against 89-98). The choices
    of 384 grid shape/loop/device cases stayed the same."""
    chosen = {_stages(proxy): proxy}
    for _, plan in ranked:
        if len(chosen) >= max(count, 2):
            break
        chosen.setdefault(_stages(plan), plan)
    if extra and (not ranked or extra[0][0] < ranked[0][0]):
        chosen.setdefault(_stages(extra[0][1]), extra[0][1])
    for _, plan in few:
        chosen.setdefault(_stages(plan), plan)
    modelled: dict[object, float] = {}
    for ms, plan in [*ranked, *extra, *few]:
        key = _stages(plan)
        modelled[key] = min(ms, modelled.get(key, math.inf))
    return [plan for _, plan in sorted(chosen.items(), key=lambda item: modelled.get(item[0], math.inf))]


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
    found = _steady_search.steady_search(chains.ticks, n, rounds, chains)
    return base if found is None else Plan.from_stages(*found, costs, n, num_microbatches)


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
