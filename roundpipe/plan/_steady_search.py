"""The steady-state search: the even plan with the shortest modelled async iteration.

Why a module of its own: it is `partition(steady=True)`'s answer, a search with its own pruning
(lower bounds first, exact periods only while one could still win) over the even chains that
`_candidates` cuts; `_candidates` makes plans and must not know how one is picked. Plain integers
(ticks) only: it must never build `Plan` objects, raise on user input, or import torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from roundpipe.plan._candidates import EvenChains, Stages
from roundpipe.plan._steady import steady_bound_ticks, steady_period

if TYPE_CHECKING:
    from roundpipe.plan._search import Ticks

STEADY_MAX_SPREAD = 1.5
"""The steady-state model is trusted for plans whose slowest stage is at most this many times the
mean stage: a much slower stage (typically one forward stage holding every layer) feeds the runs
after it slower than they compute, and they then hold their devices longer than the model counts
(measured: 15-20% bubble where it predicts 3%). Such plans are not candidates."""


def steady_search(
    ticks: Ticks, num_devices: int, rounds: Sequence[int], chains: EvenChains | None = None
) -> Stages | None:
    """The plan with the shortest modelled async iteration (`steady_period`), or None.

    Candidates: every fused suffix that fits memory and is not slower than the spread allows; every
    slot count S from N (fewer slots leave devices idle in every round; more if memory needs them)
    up to 2N more; even chains (`EvenChains.plans`); and no fused stage slower than all the others.
    Ties go to fewer slots, then to a longer fused stage. `steady_bound` orders the candidates, so
    most are never timed exactly. ``chains`` (over ``ticks``) shares its splits with the caller.
    """
    n, fwd, fb = ticks.n, ticks.fwd, ticks.fb
    total = fwd[n] + fb[n]  # an upper bound of any plan's work (everything recomputed)
    chains = chains if chains is not None else EvenChains(ticks)
    # From N (or the fewest slots memory allows) up to 2N more: beyond, stages only get smaller
    # while the transfers per slot (not in the model) grow.
    lowest = max(num_devices, ticks.probe(ticks.t_top)[0])
    pairs: list[tuple[float, int, int, int]] = []  # (work bound, order, slot count, fused start)
    for s_count in range(lowest, max(3 * num_devices, lowest + 2 * num_devices) + 1):
        for p in range(n - 1, ticks.p_mem - 1, -1):
            if fb[n] - fb[p] > STEADY_MAX_SPREAD * total / s_count:
                break  # longer suffixes are slower still
            # `steady_bound`'s first term, exactly: every plan of p has the work fwd[p] + fb[n]
            work = sum(rounds) * math.fsum([fwd[p] + fb[n]]) / num_devices
            pairs.append((work, len(pairs), s_count, p))
    pairs.sort()

    def candidates(pair: tuple[float, int, int, int]) -> Iterable[Candidate]:
        _, order, s_count, p = pair
        fused_t = fb[n] - fb[p]
        for k, (slots, stages) in enumerate(chains.plans(s_count, p)):
            others = slots[: len(stages[0])] + slots[len(stages[0]) + 1 :]
            if p and fused_t > max(others):
                continue  # a fused stage slower than all others starves the backward stages behind it
            if max(slots) * len(slots) > STEADY_MAX_SPREAD * sum(slots):
                continue
            yield steady_bound_ticks(slots, num_devices, rounds), len(slots), p, order, k, slots, stages

    return _least_period(pairs, candidates, num_devices, rounds)


Candidate = tuple[float, int, int, int, int, list[int], Stages]
"""A plan of `steady_search`: its bound, slot count, fused start, place in the search's order, then
its slot times and stages."""


def _least_period(
    pairs: list[tuple[float, int, int, int]],
    candidates: Callable[[tuple[float, int, int, int]], Iterable[Candidate]],
    num_devices: int,
    rounds: Sequence[int],
) -> Stages | None:
    """Exact periods in order of the lower bounds (then fewer slots, a longer fused stage, search
    order), until no bound can beat (or tie) the best. Periods within float noise of each other
    tie: then fewer slots, then a longer fused stage. The plans of a (slot count, fused start) pair
    are cut only once the pair's work bound (``pairs``, ascending) could come first: each of its
    plans' bounds is at least that, so the order is that of all plans bounded and sorted."""
    best_period = math.inf
    best_tie = (0, 0)
    best_plan: Stages | None = None
    heap: list[Candidate] = []
    at = 0
    while True:
        while at < len(pairs) and (not heap or pairs[at][0] <= heap[0][0]):
            for candidate in candidates(pairs[at]):
                heapq.heappush(heap, candidate)
            at += 1
        if not heap:
            return best_plan
        bound, s_count, p, _, _, slots, plan = heapq.heappop(heap)
        if bound > best_period * (1 + 1e-9):
            return best_plan
        period = steady_period(slots, num_devices, rounds)
        if period < best_period * (1 - 1e-9) or (
            period <= best_period * (1 + 1e-9) and (s_count, p) < best_tie
        ):
            best_period, best_tie, best_plan = period, (s_count, p), plan
