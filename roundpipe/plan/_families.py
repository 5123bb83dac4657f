"""The candidates `choose_plan` times: families of even plans around the proxies, ranked by model.

Why a module of its own: which plans are worth timing is a question of its own, answered by
measured rules (each constant below says what it finds, where and at what planning cost): the
neighbourhood of the proxies' plans, wider and finer plans, the few-slot plans a loop runs side
by side, plans of equal stages and of dealt backward stages. It only generates and ranks
(`_ranking`); it must never time a plan (`roundpipe.plan.choose` does, through `_Timer`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from roundpipe.plan import _candidates
from roundpipe.plan._ranking import _Candidate, _rank, _stages, _StageTimes
from roundpipe.plan._stream_graph import Shape
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import Plan

Ranked = list[tuple[float, Plan]]
"""Plans with their modelled times, best first."""

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
) -> tuple[Ranked, Ranked, Ranked, Ranked]:
    """Even plans around each proxy plan (and the proxies; sync, also those of more slots up to
    `many_slots`), best modelled first; apart, the best
    modelled of the even plans with N+1 to 2N slots and a fused stage about the mean slot;
    (``loop``, async) the best of the even plans of up to N slots by the model of a training
    loop's submission (`_few_best`); and the best ``dealt`` of the plans with 2N backward stages
    beyond 2N slots and the best ``wider_listed`` of the wider plans below, by that model too
    (`_also_listed`).

    Those wider plans (a 1-3 layer fused stage, stages a little shorter than with N slots) are the
    fastest on several grid shapes (up to 11% faster than the others), but the ranking model is
    off by up to 20% on async plans: ranked with the rest they displace, on other shapes, the plan
    the engine prefers. So the best of them is timed in addition, and only when the model puts it
    first of all. ``needed``: how many of the ranked plans the caller reads, best first."""
    n = proxies[0].num_devices
    pool, few, wider = _gathered(costs, proxies, chains, rounds, async_optimizer)
    # Sync bounds are meant as true lower bounds of the model, so that the first ``needed`` are
    # exact with ``keep=needed`` (they are not quite: see `_rank`'s shared bound); the async
    # window's time per iteration can fall under its bound (iterations overlap), so there the
    # margin of 4 stays.
    keep = 4 if async_optimizer else needed
    ranked = _rank(
        list(pool.plans.values()),
        *(n, rounds, async_optimizer),
        keep=keep,
        reads=max(keep, needed),
        times=pool.times,
        # Sync: the proxies first (a good plan, whose time then prunes the rest sooner: 3 of 40 ms
        # at 94 layers); the order changes what is pruned, not the first ``reads`` (see `_rank`).
        first=0 if async_optimizer else len(proxies),
        shapes=pool.shapes,
        # A loop waiting for each loss: every candidate by the loop's model (the late loop runs
        # most plans as a chained run does, so its ranking stays chained).
        loop=loop and not late,
    )
    # With sync bounds (as above) a wider plan whose bound is past the best modelled plan above
    # could not be timed (see `choose_plan`), so it need not be modelled.
    cutoff = ranked[0][0] if ranked and not async_optimizer else math.inf
    extra = _rank(list(wider.values()), n, rounds, async_optimizer, keep=1, cutoff=cutoff, **pool.shared())
    few_best = _few_best(pool, few, ranked, chains, loop, late)
    also_listed = _also_listed(pool, ranked, chains, wider, needed, dealt, wider_listed)
    return ranked, extra[:1], few_best, also_listed


@dataclass
class _Pool:
    """The candidates of one `_ranked_candidates` call and what every ranking of them shares: the
    stage times, the stream model's task graphs (built once per plan shape), the run's devices,
    microbatches and rounds."""

    times: _StageTimes
    num_devices: int
    num_microbatches: int
    rounds: tuple[int, ...]
    plans: dict[object, _Candidate]
    shapes: dict[object, Shape] = field(default_factory=dict)

    def apart(
        self, family: Iterable[_candidates.EvenPlan], *seen: dict[object, _Candidate]
    ) -> dict[object, _Candidate]:
        """A family's plans not among ``plans`` nor ``seen``, to be ranked apart from them."""
        out: dict[object, _Candidate] = {}
        for _, stages in family:
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            if key not in self.plans and key not in out and all(key not in other for other in seen):
                out[key] = _Candidate(None, key, self.times.of(*key), self.num_devices, self.num_microbatches)
        return out

    def shared(self) -> dict[str, Any]:
        """What every `_rank` call of the pool passes: the stage times and the task graphs."""
        return {"times": self.times, "shapes": self.shapes}

    def best_in_loop(
        self, candidates: dict[object, _Candidate], keep: int, cutoff: float = math.inf, late: bool = False
    ) -> list[tuple[float, Plan]]:
        """The best ``keep`` of ``candidates`` by the model of a training loop's submission (one
        loss late with ``late``), none past ``cutoff``."""
        return _rank(
            list(candidates.values()),
            self.num_devices,
            self.rounds,
            True,
            keep=keep,
            cutoff=cutoff,
            times=self.times,
            loop=True,
            late=late,
            shapes=self.shapes,
        )[:keep]


def _gathered(
    costs: LayerCosts,
    proxies: list[Plan],
    chains: _candidates.EvenChains,
    rounds: tuple[int, ...],
    async_optimizer: bool,
) -> tuple[_Pool, dict[object, _Candidate], dict[object, _Candidate]]:
    """The ranked families' plans, the proxies first (`_ranked_candidates`); the plans of up to N
    slots among them; and apart from them the wider plans, of N+1 to 2N slots."""
    n, m = proxies[0].num_devices, proxies[0].num_microbatches
    longer = 0 if async_optimizer else SYNC_LONGER_FUSED
    pool = _Pool(_StageTimes(costs), n, m, rounds, {_stages(p): _Candidate(p) for p in proxies})
    around = (
        _candidates.neighbourhood(chains, proxy.num_slots, proxy.fused.start, SLOT_REACH, FUSED_REACH)
        for proxy in proxies
    )
    families = [*around, _candidates.balanced_fused(chains, range(1, n + 1), longer)]
    if not async_optimizer:  # and the sync plans of more slots than the proxies' (`many_slots`)
        top = max(p.num_slots for p in proxies) + SLOT_REACH
        families.append(_candidates.balanced_fused(chains, range(top + 1, many_slots(n, m) + 1)))
        families.append(_candidates.finest(chains, FINEST_FUSED_LAYERS))
    plans, few = pool.plans, dict[object, _Candidate]()
    for family in families:
        for _, stages in family:
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            if key not in plans:
                plans[key] = _Candidate(None, key, pool.times.of(*key), n, m)
            if len(stages[0]) + 1 + len(stages[2]) <= n:
                few[key] = plans[key]
    wider = pool.apart(_candidates.balanced_fused(chains, range(n + 1, 2 * n + 1), longer))
    return pool, few, wider


def _few_best(
    pool: _Pool,
    few: dict[object, _Candidate],
    ranked: list[tuple[float, Plan]],
    chains: _candidates.EvenChains,
    loop: bool,
    late: bool,
) -> list[tuple[float, Plan]]:
    """(``loop``) The best of the plans of up to N slots by the loop's model; for a loop one loss
    late also the chained ranking's best few of them (`LATE_FEW_TIMED`), the best by that loop's
    own model (`LATE_MODELLED`) and the best of equal stages (`LATE_EQUAL_TIMED`).

    Why: the async ranking models a chained run (cheap to prune, and it orders the many-slot plans
    as the loop's evaluation does), but a plan of up to N slots runs its rounds side by side, and
    the idle devices a chained run lends to the next iteration a loop cannot lend, so the chained
    model ranks those plans against the rest by a time they do not run in. Among themselves they
    are ranked by the loop's model (`stream_ms` with ``gate``), and their best is timed in
    addition. On the 48 (8, 16) async grid shapes of 24-32 layers that brings the chosen plan
    within 0.19% of the fastest even plan on the mean (2.5% at most), against 4.0% (11.8%) with
    the chained ranking alone; ranking every candidate by the loop's model instead made 20 of 64
    grid shapes slower, by up to 8.4% (docs/performance.md)."""
    n = pool.num_devices
    few_best = pool.best_in_loop(few, 1) if loop else []
    if late:  # a loop one loss late runs most plans as the chained model does (`choose_plan`):
        # the best few-slot plans of the chained ranking above (modelled there already)
        few_best += [timed for timed in ranked if timed[1].num_slots <= n][:LATE_FEW_TIMED]
        if LATE_MODELLED:  # and the best few by the model of a loop one loss late
            few_best += pool.best_in_loop(few, LATE_MODELLED, late=True)
        if LATE_EQUAL_TIMED:  # and of the plans of equal stages, not among them
            equal = pool.apart(_candidates.equal_splits(chains, range(1, n + 1), EQUAL_SPLIT_REACH), few)
            few_best += pool.best_in_loop(equal, LATE_EQUAL_TIMED, late=True)
    return few_best


def _also_listed(
    pool: _Pool,
    ranked: list[tuple[float, Plan]],
    chains: _candidates.EvenChains,
    wider: dict[object, _Candidate],
    needed: int,
    dealt: int,
    wider_listed: int,
) -> list[tuple[float, Plan]]:
    """The best ``dealt`` of the plans with 2N backward stages beyond 2N slots
    (`_candidates.dealt_backward`) by the loop's model, those it puts no slower than the
    ``needed``-th of ``ranked`` (`DEALT_LISTED`), and with them the best ``wider_listed`` of the
    ``wider`` plans by that model, on the same condition (`WIDER_LISTED`)."""
    also_listed: list[tuple[float, Plan]] = []
    if ranked:  # by the loop's model, as ``ranked``, and only where they would be listed
        listed_ms = ranked[min(len(ranked), needed) - 1][0]
        if dealt:
            others = pool.apart(_candidates.dealt_backward(chains, pool.num_devices), wider)
            also_listed += pool.best_in_loop(others, dealt, cutoff=listed_ms)
        if wider_listed:
            also_listed += pool.best_in_loop(wider, wider_listed, cutoff=listed_ms)
    return also_listed
