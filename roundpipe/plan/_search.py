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

The second half serves ``partition(steady=True)``: a max-plus model of the async steady state
(`steady_period`, `steady_bound`), even chain splits (`balanced_split`) and the candidate search
over them (`steady_search`).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

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
        out: list[list[range]] = []
        for pre in (self.fwd, self.fb):
            runs: list[range] = []
            i = 0
            while i < p:
                j = min(bisect_right(pre, pre[i] + t, i + 1, p + 1) - 1, self.reach[i])
                runs.append(range(i, j))
                i = j
            out.append(runs)
        return out[0], range(p, self.n), out[1][::-1]


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


# --------------------------------------------------------------------------- steady state (async)
#
# With the asynchronous optimizer, iterations chain without a flush, so what costs time is not the
# fill and drain but how the round-robin stream of stage runs paces itself. Run k of the stream
# (slot k mod S of its round) goes to device k mod N; its first microbatch waits for the same
# microbatch of run k-1 (same round), its device is busy with run k-N for that run's M_R stage
# times, and at most one stage is prefetched, so it also waits for the last microbatch of run k-2N.
# That is a max-plus linear system; its throughput is the largest cycle ratio of the graph below
# (weights in ms, transits in iterations), found exactly by policy iteration (Howard's algorithm).


def _steady_graph(
    slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int]
) -> list[list[tuple[int, float, int]]]:
    """In-arcs (source, weight ms, transit in iterations) of every node; run n of one iteration has
    node 2n (its first microbatch starts) and 2n+1 (its last microbatch ends)."""
    s_count = len(slot_ms)
    period = s_count * len(rounds)
    ins: list[list[tuple[int, float, int]]] = [[] for _ in range(2 * period)]

    def earlier(n: int, back: int) -> tuple[int, int]:
        q, m = divmod(n - back, period)
        return m, -q

    for n in range(period):
        rnd, i = divmod(n, s_count)
        busy = rounds[rnd] * slot_ms[i]
        start, end = 2 * n, 2 * n + 1
        if i:  # microbatch 0 arrives from the previous slot of the round
            ins[start].append((2 * (n - 1), slot_ms[i - 1], 0))
        src, q = earlier(n, num_devices)  # the device's previous run
        ins[start].append((2 * src, rounds[src // s_count] * slot_ms[src % s_count], q))
        src, q = earlier(n, 2 * num_devices)  # one stage of prefetch: the run before that has ended
        ins[start].append((2 * src + 1, 0.0, q))
        ins[end].append((start, busy, 0))
        if i:  # the last microbatch cannot end before it left the previous slot
            ins[end].append((2 * (n - 1) + 1, slot_ms[i], 0))
    return ins


def steady_period(slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int]) -> float:
    """Milliseconds per iteration of an endless async stream of iterations (the model above).

    Every zero-transit arc goes forward within a round, so every cycle has a positive transit and
    the ratio is well defined. Policy iteration: each node keeps one in-arc; the policy graph's
    cycles give each node a ratio (eta) and a bias (x); nodes switch to an in-arc with a larger
    ratio, else (same ratio) a larger bias, until nothing improves.
    """
    ins = _steady_graph(slot_ms, num_devices, rounds)
    count = len(ins)
    # Start from the heaviest arc that crosses the most iterations: close to the final policy.
    policy = [max(range(len(arcs)), key=[(t, w) for _, w, t in arcs].__getitem__) for arcs in ins]
    x = [0.0] * count
    eta = [0.0] * count
    tol = 1e-12 * max(1.0, max(slot_ms, default=0.0) * max(rounds) * count)
    for _ in range(4 * count + 16):
        state = [0] * count  # 0 new, 1 on the current path, 2 valued
        for first in range(count):
            if state[first]:
                continue
            path = []
            v = first
            while not state[v]:
                state[v] = 1
                path.append(v)
                v = ins[v][policy[v]][0]
            stop = len(path)
            if state[v] == 1:  # a new cycle: path[k:] in reverse arc order
                k = path.index(v)
                cycle = path[k:]
                weight = sum(ins[c][policy[c]][1] for c in cycle)
                transit = sum(ins[c][policy[c]][2] for c in cycle)
                ratio = weight / transit
                for j in range(len(path) - 1, k, -1):  # the anchor path[k] keeps its bias
                    c = path[j]
                    u, w, t = ins[c][policy[c]]
                    x[c] = x[u] + w - ratio * t
                    eta[c] = ratio
                eta[v] = ratio
                stop = k
            for j in range(stop - 1, -1, -1):
                c = path[j]
                u, w, t = ins[c][policy[c]]
                eta[c] = eta[u]
                x[c] = x[u] + w - eta[u] * t
            for c in path:
                state[c] = 2
        changed = False
        for v, arcs in enumerate(ins):
            best = eta[arcs[policy[v]][0]]
            for j, (u, _, _) in enumerate(arcs):
                if eta[u] > best + tol:
                    best, policy[v], changed = eta[u], j, True
        if not changed:
            for v, arcs in enumerate(ins):
                u, w, t = arcs[policy[v]]
                best = x[u] + w - eta[u] * t
                for j, (u, w, t) in enumerate(arcs):
                    if abs(eta[u] - eta[v]) <= tol and x[u] + w - eta[u] * t > best + tol * 1e3:
                        best, policy[v], changed = x[u] + w - eta[u] * t, j, True
        if not changed:
            return max(eta)
    raise AssertionError("policy iteration did not converge")  # finite policies: cannot happen


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

    def nxt(i: int, t: int) -> int:
        return min(bisect_right(pre, pre[i] + t, i + 1, stop + 1) - 1, reach[i])

    def count(t: int) -> int:
        i = used = 0
        while i < stop:
            i, used = nxt(i, t), used + 1
        return used

    lo = max(max(pre[i + 1] - pre[i] for i in range(stop)), -(-(pre[stop] - pre[0]) // parts))
    hi = pre[stop] - pre[0]
    while lo < hi:  # the least largest part, on integers
        mid = (lo + hi) // 2
        if count(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    t = lo
    if count(t) > parts:
        return None  # memory cuts the chain into more parts than asked for
    cover = [0] * (stop + 1)  # cover[i]: parts the rest [i, stop) needs at t (greedy is least)
    for i in range(stop - 1, -1, -1):
        cover[i] = 1 + cover[nxt(i, t)]

    def cut(targets: Sequence[float] | None) -> list[range]:
        """Left to right, each part as close as it can be to its target (default: an equal share
        of what is left) while the rest still fits in the parts left."""
        remaining = list(targets) if targets is not None else []
        out: list[range] = []
        i = 0
        for left in range(parts, 1, -1):
            j_max = min(nxt(i, t), stop - (left - 1))
            j_min = i + 1
            while cover[j_min] > left - 1:
                j_min += 1  # a shorter part would leave the rest more than left-1 parts
            goal = remaining[0] if remaining else (pre[stop] - pre[i]) / left
            j = min(range(j_max, j_min - 1, -1), key=lambda k: abs(pre[k] - pre[i] - goal))
            if remaining:  # this part used up the target nearest to what it got
                got = pre[j] - pre[i]
                remaining.remove(min(remaining, key=lambda w: abs(w - got)))
            out.append(range(i, j))
            i = j
        out.append(range(i, stop))
        return out

    # Even parts first; then the same sizes again, in order (largest first, or last).
    even = cut(None)
    sizes = sorted((pre[r.stop] - pre[r.start] for r in even), reverse=not larger_last)
    return cut(sizes)


STEADY_MAX_SPREAD = 1.5
"""The steady-state model is trusted for plans whose slowest stage is at most this many times the
mean stage: a much slower stage (typically one forward stage holding every layer) feeds the runs
after it slower than they compute, and they then hold their devices longer than the model counts
(measured: 15-20% bubble where it predicts 3%). Such plans are not candidates."""


def steady_bound(slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int]) -> float:
    """A lower bound of `steady_period`, in O(S): the ratios of two kinds of cycles of its graph.

    Device cycles: a device's runs visit the slots i, i+N, i+2N, ... (mod S), a class of
    S/g slots (g = gcd(S, N)), and the class's runs must follow each other on N/g devices. Wave
    cycles: the first microbatch walks slots h-D..h (D = S-N >= 0) and slot h's device then runs
    slot h-D of the next round, so each round that chain plus slot h's whole run follow each other.
    """
    s_count, n = len(slot_ms), num_devices
    bound = sum(rounds) * math.fsum(slot_ms) / n  # N devices share all the work of an iteration
    g = math.gcd(s_count, n)
    if g > 1 and len(set(rounds)) == 1:  # each device only ever sees one class of slots
        bound = max(bound, sum(rounds) * g * max(math.fsum(slot_ms[i::g]) for i in range(g)) / n)
    d = s_count - n
    if d >= 0:  # (with fewer slots than devices, a device's next run is not in the next round)
        for h in range(d, s_count):  # one wave cycle per round, around the iteration
            bound = max(bound, len(rounds) * math.fsum(slot_ms[h - d : h]) + sum(rounds) * slot_ms[h])
    return bound


def steady_search(
    ticks: Ticks, num_devices: int, rounds: Sequence[int]
) -> tuple[list[range], range, list[range]] | None:
    """The plan with the shortest modelled async iteration (`steady_period`), or None.

    Candidates: every fused suffix that fits memory and is not slower than the spread allows; every
    slot count S from N (fewer slots leave devices idle in every round; more if memory needs them)
    up to 2N more; the forward/backward stage counts nearest the even split of the work, and at
    least what memory needs (each chain cut by `balanced_split`); and no fused stage slower than
    all the others. Ties go to fewer slots, then to a longer fused stage. `steady_bound` orders
    the candidates, so most are never timed exactly.
    """
    n, fwd, fb, reach = ticks.n, ticks.fwd, ticks.fb, ticks.reach
    total = fwd[n] + fb[n]  # an upper bound of any plan's work (everything recomputed)
    splits: dict[tuple[int, int, int], list[range] | None] = {}

    def split(chain: int, p: int, parts: int) -> list[range] | None:
        key = (chain, p, parts)
        if key not in splits:
            # Larger stages first in dispatch order (backward stages run deepest first): a heavy
            # run early in a round delays only that round's wave, a heavy run late in it holds up
            # the device that the next round needs (measured: 284.7 vs 308.4 ms per iteration).
            splits[key] = balanced_split(fb if chain else fwd, p, parts, reach, larger_last=bool(chain))
        return splits[key]

    def memory_parts(p: int) -> int:
        i = parts = 0
        while i < p:
            i, parts = min(reach[i], p), parts + 1
        return parts

    # From N (or the fewest slots memory allows) up to 2N more: beyond, stages only get smaller
    # while the transfers per slot (not in the model) grow.
    fewest = ticks.probe(ticks.t_top)[0]
    lowest = max(num_devices, fewest)
    candidates = []
    for s_count in range(lowest, max(3 * num_devices, lowest + 2 * num_devices) + 1):
        for p in range(n - 1, ticks.p_mem - 1, -1):
            fused_t = fb[n] - fb[p]
            if fused_t > STEADY_MAX_SPREAD * total / s_count:
                break  # longer suffixes are slower still
            if p == 0:
                options = [(0, 0)] if s_count == 1 else []
            else:
                work_f, work_b = fwd[p], fb[p]
                even = (s_count - 1) * work_f / (work_f + work_b) if work_f + work_b else 1
                need = memory_parts(p)  # both chains hold the same layers: the same memory cuts
                counts = {math.floor(even), math.ceil(even), round(even) + 1}
                options = [
                    (kf, s_count - 1 - kf) for kf in {min(max(k, need), s_count - 1 - need) for k in counts}
                ]
            for kf, kb in options:
                if p and not (1 <= kf <= p and 1 <= kb <= p):
                    continue
                f_parts = split(0, p, kf) if p else []
                b_parts = split(1, p, kb) if p else []  # deepest first in dispatch: larger there
                if f_parts is None or b_parts is None:
                    continue
                slots = [fwd[r.stop] - fwd[r.start] for r in f_parts]
                slots += [fb[r.stop] - fb[r.start] for r in reversed(b_parts)]
                if p and fused_t > max(slots):
                    continue  # a fused stage slower than all others starves the backward stages behind it
                slots.insert(len(f_parts), fused_t)
                if max(slots) * len(slots) > STEADY_MAX_SPREAD * sum(slots):
                    continue
                plan = (f_parts, range(p, n), b_parts[::-1])
                candidates.append((steady_bound(slots, num_devices, rounds), len(slots), p, slots, plan))
    # Exact periods in order of their lower bounds, until no bound can beat (or tie) the best.
    # Periods within float noise of each other tie: then fewer slots, then a longer fused stage.
    candidates.sort(key=lambda c: c[:3])
    best_period = math.inf
    best_tie = (0, 0)
    best_plan: tuple[list[range], range, list[range]] | None = None
    for bound, s_count, p, slots, plan in candidates:
        if bound > best_period * (1 + 1e-9):
            break
        period = steady_period(slots, num_devices, rounds)
        if period < best_period * (1 - 1e-9) or (
            period <= best_period * (1 + 1e-9) and (s_count, p) < best_tie
        ):
            best_period, best_tie, best_plan = period, (s_count, p), plan
    return best_plan
