"""The exact search behind `partition`: integer costs, greedy probes, branch and bound over t_max.

It exists so that `partition.py` can stay a readable description of plans while the fast part
lives here. Costs are turned into integer *ticks* (scaled by a power of two, rounded), so every
sum, comparison and objective value below is exact and the result is deterministic. This module
must never build `Plan` objects, raise on user input (partition validates first), or import torch.

For a bound T on the stage time, `Ticks.probe(T)` packs greedily: the fused stage is the longest
suffix whose forward+backward fits T (and the memory cap), then forward stages left to right over
the remaining layers, then backward stages left to right over the same layers. Greedy packing
gives the fewest stages for that T, and a longer fused stage never needs more forward or backward
stages, so the slot count S(T) of a probe is the least any plan with stages <= T can have. S(T)
only falls as T grows, so the best plan sits at a *breakpoint*: the least T with S(T) <= s, for
some s. `search` finds the breakpoints that can still beat the best plan seen, by bisecting
intervals of T, snapping each probe down to the largest stage it really built (the same greedy),
jumping the lower end to the next T at which any greedy boundary can move, and dropping intervals
whose lower bound cannot win.

``partition(steady=True)`` is served by ``_steady`` (the max-plus model of the async steady state)
and ``_candidates`` (even chains and the search over them); `steady_period` is re-exported here
for `dispatch`.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

from roundpipe.plan._steady import steady_period

__all__ = ["Ticks", "search", "steady_period", "to_ticks"]

_TICK_BITS = 44  # the largest total becomes about 2**44 ticks: ~1e-13 relative resolution


def to_ticks(fwd_ms: Sequence[float], bwd_ms: Sequence[float]) -> tuple[list[int], list[int]]:
    """Forward and forward+backward costs as integers, scaled by one power of two.

    Scaling by a power of two is exact, so costs that are short binary fractions (0.25, 3.5, ...)
    keep exact ties; the rounding of anything else is ~1e-13 of the total work.
    """
    total = math.fsum(fwd_ms) * 2 + math.fsum(bwd_ms)
    shift = _TICK_BITS - math.frexp(total)[1] if total > 0 else 0
    f = [round(math.ldexp(x, shift)) for x in fwd_ms]
    c = [fx + round(math.ldexp(x, shift)) for fx, x in zip(f, bwd_ms, strict=True)]
    return f, c


class Ticks:
    """Prefix sums and memory reach of one cost table; answers greedy probes in O(S log L)."""

    def __init__(self, fwd: Sequence[int], fb: Sequence[int], mem: Sequence[int], cap: int | None) -> None:
        n = len(fwd)
        self.n = n
        self.fwd = [0, *accumulate(fwd)]
        self.fb = [0, *accumulate(fb)]
        mm = [0, *accumulate(mem)]
        self.t_low = max(fb)  # every layer sits in a fwd+bwd sum somewhere; no plan beats this
        self.t_top = self.fb[n]  # with T this large only memory limits the stages
        if cap is None:
            self.reach = [n] * (n + 1)
            self.p_mem = 0
        else:  # reach[i]: the furthest stage end from layer i under the memory cap
            reach = [n] * (n + 1)
            j = 0
            for i in range(n):
                j = max(j, i)
                while j < n and mm[j + 1] - mm[i] <= cap:
                    j += 1
                reach[i] = j
            self.reach = reach
            self.p_mem = bisect_left(mm, mm[n] - cap)  # the longest fused suffix memory allows
        self.probes = 0

    def fused_start(self, t: int) -> int:
        fb, n = self.fb, self.n
        return max(bisect_left(fb, fb[n] - t), self.p_mem)

    def probe(self, t: int) -> tuple[int, int, int, int]:
        """Greedy at bound ``t`` -> (slots, largest stage built, next T where a boundary moves, fused start)."""
        self.probes += 1
        fb, n, reach = self.fb, self.n, self.reach
        p = self.fused_start(t)
        largest = fb[n] - fb[p]
        nxt = fb[n] - fb[p - 1] if p > self.p_mem else math.inf
        stages = 0
        for pre in (self.fwd, fb):
            i = 0
            while i < p:
                base = pre[i]
                j = bisect_right(pre, base + t, i + 1, p + 1) - 1
                r = reach[i]
                if j >= r:
                    j = r  # memory ends this stage; a larger T will not move it
                elif j < p:
                    grown = pre[j + 1] - base
                    if grown < nxt:
                        nxt = grown
                size = pre[j] - base
                if size > largest:
                    largest = size
                stages += 1
                i = j
        return stages + 1, largest, int(nxt) if nxt != math.inf else -1, p

    def stages(self, t: int) -> tuple[list[range], range, list[range]]:
        """The greedy plan at bound ``t``: forward stages, fused stage, backward stages (deepest first)."""
        p = self.fused_start(t)
        return self.cut(self.fwd, p, t), range(p, self.n), self.cut(self.fb, p, t)[::-1]

    def cut(self, pre: Sequence[int], stop: int, t: int) -> list[range]:
        """Layers [0, ``stop``) of one chain (prefix sums ``pre``: `fwd` or `fb`) cut greedily, each
        stage as long as ``t`` and memory allow (``t`` at least every layer's time there)."""
        runs: list[range] = []
        i = 0
        while i < stop:
            j = min(bisect_right(pre, pre[i] + t, i + 1, stop + 1) - 1, self.reach[i])
            runs.append(range(i, j))
            i = j
        return runs


def search(ticks: Ticks, num_microbatches: int, fill_drain: int, slot_floor: int) -> int:
    """The bound T (ticks) of the best plan: least (M*max(S, floor) + fill_drain) * t, then fewer slots,
    then a longer fused stage. ``t`` is the largest stage really built, so the key is exact."""
    m = num_microbatches
    fb_total = ticks.fb[ticks.n]

    def key(slots: int, t: int, p: int) -> tuple[int, int, int]:
        return ((m * max(slots, slot_floor) + fill_drain) * t, slots, p)

    s_lo, t_lo, ev_lo, p_lo = ticks.probe(ticks.t_low)
    best = key(s_lo, t_lo, p_lo)
    best_t = t_lo
    s_hi, t_hi, _, p_hi = ticks.probe(ticks.t_top)
    if key(s_hi, t_hi, p_hi) < best:
        best, best_t = key(s_hi, t_hi, p_hi), t_hi

    # Interval (lo, hi]: S(lo) = s_lo > s_hi = S(hi), hi a stage size really built, nothing
    # changes below ev_lo. Every breakpoint still unseen lies in some such interval.
    heap: list[tuple[int, int, int, int, int, int, int, int]] = []

    def push(lo: int, s_lo: int, ev_lo: int, hi: int, s_hi: int, p_hi: int) -> None:
        if s_lo == s_hi or ev_lo < 0 or ev_lo >= hi:
            return
        # Inside: T >= ev_lo and S >= s_hi; and S*t >= total work, which only grows as the
        # fused stage shrinks (p >= p_hi).
        s_min = max(s_hi, slot_floor)
        bound = max((m * s_min + fill_drain) * ev_lo, m * (ticks.fwd[p_hi] + fb_total) + fill_drain * ev_lo)
        heapq.heappush(heap, (bound, s_hi, lo, s_lo, ev_lo, hi, s_hi, p_hi))

    push(t_lo, s_lo, ev_lo, t_hi, s_hi, p_hi)
    while heap:
        bound, s_least, lo, s_lo, ev_lo, hi, s_hi, p_hi = heapq.heappop(heap)
        if (bound, s_least) >= best[:2]:
            break  # no interval left can beat (or tie with fewer slots) the best plan
        mid = max(ev_lo, (lo + hi) // 2)
        s_m, t_m, ev_m, p_m = ticks.probe(mid)
        k = key(s_m, t_m, p_m)
        if k < best:
            best, best_t = k, t_m
        if s_m != s_hi:
            push(mid, s_m, ev_m, hi, s_hi, p_hi)
        if s_m != s_lo:
            push(lo, s_lo, ev_lo, t_m, s_m, p_m)
    return best_t
