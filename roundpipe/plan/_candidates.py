"""Candidate plans made of even chains.

`partition`'s t_max search gives the optimum of a proxy; several plans can share that optimum and
round-robin stalls on uneven ones (a 1-layer stage behind 9-layer stages). This module makes the
plans worth comparing: for a slot count and a fused stage, each chain (forward, backward) is cut
into the stage count nearest the even split of the work, with its largest stage as small as
possible and its stages as even as possible (`balanced_split`). `_steady_search` picks among them
by the steady-state model (``_steady``); `neighbourhood` lists them around a given plan for
`choose_plan` to order and evaluate. Plain integers (ticks) only: it must never build `Plan`
objects, raise on user input (partition validates first), or import torch.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from operator import neg, sub
from typing import TYPE_CHECKING

from roundpipe.plan import native

if TYPE_CHECKING:
    from roundpipe.plan._search import Ticks

Stages = tuple[list[range], range, list[range]]
"""Forward stages (shallow first), the fused stage, backward stages (deepest first)."""

EvenPlan = tuple[list[int], Stages]
"""Slot times in ticks (dispatch order) and the stages."""


def balanced_split(
    pre: Sequence[int], stop: int, parts: int, reach: Sequence[int], *, larger_last: bool = False
) -> list[range] | None:
    """Items [0, stop) (prefix sums ``pre``, memory ``reach``) in exactly ``parts`` consecutive
    parts whose largest is as small as possible, then as even as possible (each part the length
    closest to an equal share of what is left, among those that let the rest fit), then ordered:
    cut again aiming at the same part sizes, largest first (or last with ``larger_last``).
    None when there are fewer items than parts, or memory needs more parts."""
    if not 1 <= parts <= stop:
        return None
    kernels = native.kernels()
    if kernels is not None and isinstance(pre, array) and isinstance(reach, array):
        ends = kernels.balanced_split(pre, stop, parts, reach, larger_last)  # the same, compiled
        return None if ends is None else [range(a, b) for a, b in zip([0, *ends], ends, strict=False)]
    return _balanced_split(pre, stop, parts, reach, larger_last)


def _balanced_split(
    pre: Sequence[int], stop: int, parts: int, reach: Sequence[int], larger_last: bool
) -> list[range] | None:
    """`balanced_split` in Python (the reference of the compiled one), ``parts`` within [1, stop]."""

    def nxt(i: int, t: int) -> int:
        return min(bisect_right(pre, pre[i] + t, i + 1, stop + 1) - 1, reach[i])

    def count(t: int) -> int:
        i = used = 0
        while i < stop:
            i, used = nxt(i, t), used + 1
        return used

    t, fits_parts = _least_largest_part(pre, stop, parts, reach, nxt, count)
    if not fits_parts:
        return None  # memory cuts the chain into more parts than asked for
    # fits[k]: the least start from which the rest [start, stop) fits in k parts at t. Greedy from
    # the right gives it (each part as long as t and memory allow: sub-parts of a part fit too).
    fits = [stop]
    for _ in range(parts - 1):
        end = fits[-1]
        fits.append(max(bisect_left(pre, pre[end] - t, 0, end), bisect_left(reach, end, 0, end)))

    def cut(targets: Sequence[float] | None) -> list[range]:
        """Left to right, each part as close as it can be to its target (default: an equal share
        of what is left) while the rest still fits in the parts left."""
        remaining = list(targets) if targets is not None else []
        out: list[range] = []
        i = 0
        for left in range(parts, 1, -1):
            j_max = min(bisect_right(pre, pre[i] + t, i + 1, stop + 1) - 1, reach[i], stop - left + 1)  # nxt
            j_min = max(i + 1, fits[left - 1])  # a shorter part would leave the rest more than left-1 parts
            goal = remaining[0] if remaining else (pre[stop] - pre[i]) / left
            j = _nearest(pre, i, goal, j_min, j_max)
            if remaining:  # this part used up the target nearest to what it got
                del remaining[_nearest_target(remaining, pre[j] - pre[i], descending)]
            out.append(range(i, j))
            i = j
        out.append(range(i, stop))
        return out

    # Even parts first; then the same sizes again, in order (largest first, or last).
    descending = not larger_last
    even = cut(None)
    got = [pre[r.stop] - pre[r.start] for r in even]
    sizes = sorted(got, reverse=not larger_last)
    if got == sizes:
        # Already in order: aiming at these sizes cuts the same parts again (each part's end hits
        # its target exactly, the largest such end as the even cut chose it, and uses it up first).
        return even
    return cut(sizes)


def _nearest_target(targets: list[float], got: float, descending: bool) -> int:
    """Where in ``targets`` (sorted, descending or not) the value nearest ``got`` is, the first in
    list order on ties: ``min(range(len(targets)), key=lambda k: abs(targets[k] - got))`` by
    bisection (only the two values around ``got`` can be nearest)."""
    if descending:
        at = bisect_left(targets, -got, key=neg)  # the first value <= got
    else:
        at = bisect_left(targets, got)  # the first value >= got
    best = at if at < len(targets) else at - 1
    if at > 0:
        before = at - 1
        while before > 0 and targets[before - 1] == targets[before]:
            before -= 1  # the first of equal values
        if abs(targets[before] - got) <= abs(targets[best] - got):
            best = before
    return best


def _nearest(pre: Sequence[int], i: int, goal: float, j_min: int, j_max: int) -> int:
    """The end k in [j_min, j_max] whose part [i, k) is nearest ``goal`` (the largest k on ties):
    only the ends around where ``goal`` falls can be nearest (prefix sums never fall)."""
    at = bisect_left(pre, pre[i] + goal, j_min, j_max + 1)
    if j_min < at <= j_max:
        below, above = pre[at - 1] - pre[i] - goal, pre[at] - pre[i] - goal
        if below < 0.0 <= above:
            # The part's gap to the goal changes sign between at - 1 and at (it never falls with
            # k, rounding included), so the ends further out are no nearer and tie only with an
            # equal sum, which the window below moves to the same end: only these two are left.
            if above > -below:
                return at - 1
            while at < j_max and pre[at + 1] == pre[at]:
                at += 1  # equal sums: the largest such end
            return at
    best, best_gap = j_max, math.inf
    for k in range(min(at + 1, j_max), max(at - 2, j_min) - 1, -1):
        while k < j_max and pre[k + 1] == pre[k]:
            k += 1  # equal sums: the largest such end
        gap = abs(pre[k] - pre[i] - goal)
        if gap < best_gap or (gap == best_gap and k > best):
            best, best_gap = k, gap
    return best


def _least_largest_part(
    pre: Sequence[int],
    stop: int,
    parts: int,
    reach: Sequence[int],
    nxt: Callable[[int, int], int],
    count: Callable[[int], int],
) -> tuple[int, bool]:
    """The least t at which greedy packing of [0, stop) needs at most ``parts`` parts (``count``),
    or the total when none does; and whether that t needs at most ``parts``. Greedy's cuts stay put until t reaches the least "part + the item
    after it" of a part that memory did not end, so jumping t there skips only infeasible values:
    with near-even items a few jumps land on the answer. Bisection (on integers) takes over after
    JUMPS jumps, from the last infeasible t."""
    lo = max(max(map(sub, pre[1 : stop + 1], pre[:stop])), -(-(pre[stop] - pre[0]) // parts))
    hi = pre[stop] - pre[0]
    for _ in range(_JUMPS):
        i = used = 0
        step = hi
        while i < stop:
            base = pre[i]
            j = bisect_right(pre, base + lo, i + 1, stop + 1) - 1  # nxt(i, lo), inline: the hot loop
            r = reach[i]
            if j >= r:
                j = r
            elif j < stop and pre[j + 1] - base < step:  # the part could take one more item
                step = pre[j + 1] - base
            i, used = j, used + 1
        if used <= parts:
            return lo, True
        if step <= lo:  # (cannot happen: kept for safety) fall back to bisection
            break
        lo = step
    while lo < hi:  # the least largest part, on integers
        mid = (lo + hi) // 2
        if count(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return lo, count(lo) <= parts


_JUMPS = 8
"""Breakpoint jumps before bisection in `_least_largest_part`."""


class EvenChains:
    """Plans of even chains over one cost table, with the balanced splits cached."""

    def __init__(self, ticks: Ticks) -> None:
        self.ticks = ticks
        self._splits: dict[tuple[int, int, int], list[range] | None] = {}
        self._memory_parts: dict[int, int] = {}
        self._arrays: tuple[tuple[array, array], array] | None = None

    def split(self, chain: int, p: int, parts: int) -> list[range] | None:
        key = (chain, p, parts)
        if key not in self._splits:
            # Larger stages first in dispatch order (backward stages run deepest first): a heavy
            # run early in a round delays only that round's wave, a heavy run late in it holds up
            # the device that the next round needs (measured: 284.7 vs 308.4 ms per iteration).
            pre: Sequence[int] = self.ticks.fb if chain else self.ticks.fwd
            reach: Sequence[int] = self.ticks.reach
            if native.kernels() is not None:  # the compiled split takes arrays
                sums, reach = self._packed()
                pre = sums[chain]
            self._splits[key] = balanced_split(pre, p, parts, reach, larger_last=bool(chain))
        return self._splits[key]

    def _packed(self) -> tuple[tuple[array, array], array]:
        """The prefix sums (forward, forward + backward) and the reach as arrays, for `native`."""
        if self._arrays is None:
            ticks = self.ticks
            self._arrays = ((native.ints(ticks.fwd), native.ints(ticks.fb)), native.ints(ticks.reach))
        return self._arrays

    def memory_parts(self, p: int) -> int:
        """The fewest stages memory allows over layers [0, p) (both chains hold the same layers)."""
        if p not in self._memory_parts:
            i = parts = 0
            while i < p:
                i, parts = min(self.ticks.reach[i], p), parts + 1
            self._memory_parts[p] = parts
        return self._memory_parts[p]

    def plans(self, s_count: int, p: int) -> list[EvenPlan]:
        """Plans of ``s_count`` slots whose fused stage starts at layer ``p``: the forward/backward
        stage counts nearest the even split of the work (and at least what memory needs)."""
        ticks, n = self.ticks, self.ticks.n
        fwd, fb = ticks.fwd, ticks.fb
        fused_t = fb[n] - fb[p]
        if p == 0:
            return [([fused_t], ([], range(0, n), []))] if s_count == 1 else []
        work_f, work_b = fwd[p], fb[p]
        even = (s_count - 1) * work_f / (work_f + work_b) if work_f + work_b else 1
        need = self.memory_parts(p)
        counts = {math.floor(even), math.ceil(even), round(even) + 1}
        out: list[EvenPlan] = []
        for kf in sorted({min(max(k, need), s_count - 1 - need) for k in counts}):
            plan = self.plan(kf, s_count - 1 - kf, p)
            if plan is not None:
                out.append(plan)
        return out

    def plan(self, kf: int, kb: int, p: int) -> EvenPlan | None:
        """The plan of ``kf`` forward and ``kb`` backward stages, each chain split evenly, and the
        fused stage from layer ``p`` (0 < p); None where the counts do not fit the layers or memory."""
        ticks = self.ticks
        n, fwd, fb = ticks.n, ticks.fwd, ticks.fb
        if not (1 <= kf <= p and 1 <= kb <= p):
            return None
        f_parts, b_parts = self.split(0, p, kf), self.split(1, p, kb)
        if f_parts is None or b_parts is None:
            return None
        slots = [fwd[r.stop] - fwd[r.start] for r in f_parts]
        slots.append(fb[n] - fb[p])
        slots += [fb[r.stop] - fb[r.start] for r in reversed(b_parts)]  # deepest first: larger there
        return slots, (f_parts, range(p, n), b_parts[::-1])


def neighbourhood(
    chains: EvenChains, s_count: int, p: int, slot_reach: int, fused_reach: int
) -> Iterable[EvenPlan]:
    """Even plans with a slot count within ``slot_reach`` of ``s_count`` and a fused stage starting
    within ``fused_reach`` layers of ``p`` (inside what memory allows)."""
    ticks = chains.ticks
    for s in range(max(1, s_count - slot_reach), s_count + slot_reach + 1):
        for q in range(max(ticks.p_mem, p - fused_reach), min(ticks.n - 1, p + fused_reach) + 1):
            yield from chains.plans(s, q)


def balanced_fused(chains: EvenChains, slot_counts: Iterable[int], longer: int = 0) -> Iterable[EvenPlan]:
    """For each slot count S, even plans whose fused stage is about the mean slot: the fused
    starts around the last p at which the fused stage is still no slower than the work / S.
    Few slots and a long fused stage recompute little; with S <= N whole rounds run side by side.
    ``longer``: also fused stages starting up to that many layers earlier still."""
    ticks = chains.ticks
    for s_count in slot_counts:
        p = _mean_slot_fused_start(ticks, s_count)
        for q in range(max(ticks.p_mem, p - 1 - longer), min(ticks.n - 1, p + 1) + 1):
            yield from chains.plans(s_count, q)


def equal_splits(chains: EvenChains, slot_counts: Iterable[int], reach: int) -> Iterable[EvenPlan]:
    """For each slot count S, the even plans whose forward stages all hold one number of layers
    and whose backward stages all hold one number, with a fused stage starting (at a multiple of
    both numbers) within ``reach`` layers of the mean slot's (`balanced_fused`). Balanced by time
    alone, a chain's stages differ by a layer here and there; these do not, and a loop one loss
    late runs some of them 2-3% faster than any plan nearby (`_families.LATE_EQUAL_TIMED`)."""
    ticks = chains.ticks
    for s_count in slot_counts:
        mid = _mean_slot_fused_start(ticks, s_count)
        low, high = max(ticks.p_mem, 1, mid - reach), min(ticks.n, mid + reach + 1)
        for kf in range(1, s_count - 1):
            kb = s_count - 1 - kf
            step = math.lcm(kf, kb)
            for p in range(step * -(-low // step), high, step):
                plan = chains.plan(kf, kb, p)
                if plan is not None and all(
                    len({len(r) for r in chain}) == 1 for chain in (plan[1][0], plan[1][2])
                ):
                    yield plan


def finest(chains: EvenChains, fused_layers: int) -> Iterable[EvenPlan]:
    """Even plans whose backward stages hold one layer each (or one of them two), the fused stage
    the last 1 to ``fused_layers`` layers, and the fewest forward stages none slower than the
    slowest of those: about the most slots a plan can have before its slowest stage grows. Their
    forward/backward split is set by the backward layers, not by the even split of the work, so
    `EvenChains.plans` does not list them."""
    ticks = chains.ticks
    n, fb = ticks.n, ticks.fb
    for p in range(n - 1, max(ticks.p_mem, n - fused_layers, 1) - 1, -1):
        for kb in (p, p - 1):
            bwd = chains.split(1, p, kb) if kb >= 1 else None
            if bwd is None:
                continue
            # at least every layer's forward: each one's forward and backward is in one of these
            slowest = max(fb[n] - fb[p], *(fb[r.stop] - fb[r.start] for r in bwd))
            kf = len(ticks.cut(ticks.fwd, p, slowest))
            plan = chains.plan(max(kf, chains.memory_parts(p)), kb, p)
            if plan is not None:
                yield plan


def dealt_backward(chains: EvenChains, num_devices: int) -> Iterable[EvenPlan]:
    """Even plans of more than 2N slots with exactly 2N backward stages (1 to N forward stages,
    the fused stage about the mean slot: `balanced_fused`'s middle one). Round-robin then deals
    every device two backward runs a round. Backward runs are most of the work (1.3x to 3.8x the
    forward), so how evenly they are dealt sets the busiest device's load, which an async run
    settles at; `EvenChains.plans` splits S - 1 by the work instead and rarely gives 2N. On small
    models (24 layers on 8 devices) these plans are the fastest the exhaustive search finds,
    1.7-3.9% faster than any candidate of the other families."""
    kb = 2 * num_devices
    for kf in range(1, num_devices + 1):
        p = _mean_slot_fused_start(chains.ticks, kf + 1 + kb)
        plan = chains.plan(kf, kb, p) if p > 0 else None
        if plan is not None:
            yield plan


def _mean_slot_fused_start(ticks: Ticks, s_count: int) -> int:
    """The last fused start at which the fused stage is still no slower than the work over
    ``s_count`` slots (a longer one would be slower than the mean slot)."""
    n, fwd, fb = ticks.n, ticks.fwd, ticks.fb
    p = n - 1
    while p > ticks.p_mem and s_count * (fb[n] - fb[p - 1]) <= fwd[p - 1] + fb[n]:
        p -= 1
    return p
