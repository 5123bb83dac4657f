"""The shortcuts that make `choose_plan` fast change no plan: each equals what it replaced.

- `even_plan` is `Plan.from_stages` for the candidates' chains, field for field;
- the sync ranking bound `device_bound` never exceeds the stream model it prunes for, and adding
  up each device's slots by stride gives what adding them run by run gave, bit for bit;
- `_nearest_target` is the ``min(..., key=...)`` it replaced, ties included, and `_nearest`
  (two ends where the gap changes sign) the window search it shortcuts;
- the steady plan built with shared splits is ``partition(steady=True)``, and the steady search
  that cuts chains only where a work bound lets a plan come first is the search over all of them;
- `balanced_split`'s least start for the rest's parts (greedy from the right) is the one it
  found counting the parts of every rest;
- the stream model given up past a bound (a makespan's or a window's) was past it, and stopped at
  its window's end gives the window of the whole run; its task graph built run by run (weight
  waits on a copy of the graph without them) is the graph built task by task;
- the sync split model (`split_ms`) given up past a bound was past it, `device_bound` with its
  heads and tails never exceeds it, and modelling the proxies first ranks the same plans first;
- every async ranking (chained, a loop's, over the longer window, a loop one loss late) pruned
  by its bounds gives the first plans of modelling them all;
- timing the best-modelled plans first, so that the best time's floor spares more of the rest,
  chooses what timing every plan chooses.
"""

from __future__ import annotations

import itertools
import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import pytest

from roundpipe.plan import (
    LayerCosts,
    Plan,
    _candidates,
    _search,
    _steady_search,
    _stream,
    choose_plan,
    partition,
)
from roundpipe.plan._candidates import _nearest_target
from roundpipe.plan._ranking import _Candidate, _rank, _StageTimes, device_bound
from roundpipe.plan._split_stream import split_ms
from roundpipe.plan._steady import steady_bound, steady_period
from roundpipe.plan._stream import stream_ms
from roundpipe.plan.choose import _stages, _steady_plan, even_plan
from roundpipe.plan.rounds import round_sizes
from roundpipe.planning.ranking import EstimatingEvaluator, engine_evaluator, late_loop_evaluator


def grid_costs(layers: int, ratio: float, head: float) -> LayerCosts:
    fwd = [0.01, *[1.0] * layers, head]
    bwd = [0.01 * ratio, *[ratio] * layers, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def chains_of(costs: LayerCosts, cap: int | None = None) -> _candidates.EvenChains:
    fwd, fb = _search.to_ticks(costs.fwd_ms, costs.bwd_ms)
    return _candidates.EvenChains(_search.Ticks(fwd, fb, costs.mem_bytes, cap))


def test_even_plan_is_from_stages() -> None:
    costs = grid_costs(12, 2.5, 3.0)
    chains = chains_of(costs)
    count = 0
    for slots in range(1, 20):
        for p in range(costs.num_layers):
            for _, stages in chains.plans(slots, p):
                a, b = Plan.from_stages(*stages, costs, 4, 8), even_plan(*stages, costs, 4, 8)
                assert (a, a.slot_ms, a.t_max) == (b, b.slot_ms, b.t_max)
                count += 1
    assert count > 100


def test_device_bound_never_exceeds_the_sync_stream_model() -> None:
    rng = random.Random(8)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 4, 8])
        m = rng.choice([n, n + 1, 2 * n, 3 * n + 1])
        rounds = round_sizes(m, n)
        slots = tuple(
            rng.choice([0.01, 0.5, 1.0, 2.0, 3.7]) * rng.randint(1, 9) for _ in range(rng.randint(1, 20))
        )
        assert device_bound(slots, n, rounds) <= stream_ms(slots, n, rounds)


def nearest_by_window(pre: Sequence[int], i: int, goal: float, j_min: int, j_max: int) -> int:
    """`_candidates._nearest` as it was: every end of a window around the goal compared."""
    at = bisect_left(pre, pre[i] + goal, j_min, j_max + 1)
    best, best_gap = j_max, math.inf
    for k in range(min(at + 1, j_max), max(at - 2, j_min) - 1, -1):
        while k < j_max and pre[k + 1] == pre[k]:
            k += 1
        gap = abs(pre[k] - pre[i] - goal)
        if gap < best_gap or (gap == best_gap and k > best):
            best, best_gap = k, gap
    return best


def test_nearest_is_the_window_search() -> None:
    rng = random.Random(14)
    for _ in range(20000):
        scale = rng.choice([1, 3, 2**40])  # large ticks: the goal's rounding is coarse
        items = [rng.choice([0, 0, 1, 2, 3]) * scale for _ in range(rng.randint(1, 30))]
        pre = list(itertools.accumulate(items, initial=0))
        i = rng.randrange(len(items))
        j_min = rng.randint(i + 1, len(items))
        j_max = rng.randint(j_min, len(items))
        goal = rng.choice([rng.uniform(0, pre[-1] - pre[i] + 1), float(rng.choice(pre) - pre[i])])
        goal = goal + rng.choice([0.0, 1e-3, -1e-3, 0.5])
        args = (pre, i, goal, j_min, j_max)
        assert _candidates._nearest(*args) == nearest_by_window(*args), args


def test_nearest_target_is_the_first_nearest() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        descending = rng.random() < 0.5
        targets = sorted((rng.randint(0, 12) for _ in range(rng.randint(1, 8))), reverse=descending)
        got = rng.randint(-2, 14)
        expected = min(range(len(targets)), key=lambda k: abs(targets[k] - got))
        assert targets[_nearest_target(list(targets), got, descending)] == targets[expected]
        # the same value is removed either way: the lists left are equal
        left = list(targets)
        del left[_nearest_target(left, got, descending)]
        right = list(targets)
        right.remove(targets[expected])
        assert left == right


def test_steady_plan_with_shared_splits_is_partitions() -> None:
    for layers, ratio, head, n, m, rs in [
        (24, 2.0, 3.0, 8, 16, None),
        (28, 3.8, 1.0, 4, 8, None),
        (20, 1.3, 4.0, 2, 7, 3),
    ]:
        costs = grid_costs(layers, ratio, head)
        base = partition(costs, n, m, async_optimizer=True)
        steady = partition(costs, n, m, async_optimizer=True, steady=True, round_size=rs)
        assert _steady_plan(chains_of(costs), base, m, rs, costs) == steady


def random_stream(rng: random.Random, max_slots: int) -> tuple[int, tuple[int, ...], list[float]]:
    """A device count, its rounds and 1 to ``max_slots`` slot times, for the give-up tests."""
    n = rng.choice([1, 2, 3, 4, 8])
    rounds = round_sizes(rng.choice([n, n + 1, 2 * n, 3 * n + 1]), n)
    slots = [
        rng.choice([0.01, 0.5, 1.0, 2.0, 3.7]) * rng.randint(1, 9) for _ in range(rng.randint(1, max_slots))
    ]
    return n, rounds, slots


def test_stream_model_gives_up_only_past_its_bound() -> None:
    rng = random.Random(5)
    gave_up = 0
    for _ in range(400):
        n, rounds, slots = random_stream(rng, 20)
        full = stream_ms(slots, n, rounds)
        bound = full * rng.choice([0.9, 0.99, 1.0, 1.01])
        cut = stream_ms(slots, n, rounds, give_up=bound)
        assert cut == full or (cut == math.inf and full > bound)
        gave_up += cut == math.inf
    assert gave_up > 50


def test_stream_model_window_gives_up_only_past_its_bound() -> None:
    rng = random.Random(13)
    gave_up = 0
    for _ in range(300):
        n, rounds, slots = random_stream(rng, 16)
        s_count = len(slots)
        waits = [sorted(rng.sample(range(s_count), rng.randint(0, min(3, s_count)))) for _ in slots]
        shares = [sorted(rng.sample(range(s_count), rng.randint(0, min(3, s_count)))) for _ in slots]
        args = (slots, n, rounds)
        full = stream_ms(*args, iterations=4, window=(1, 3), weight_waits=waits, sharers=shares)
        bound = full * rng.choice([0.5, 0.9, 0.99, 1.0, 1.01])
        cut = stream_ms(*args, iterations=4, window=(1, 3), weight_waits=waits, sharers=shares, give_up=bound)
        assert cut == full or (cut == math.inf and full > bound)
        gave_up += cut == math.inf
    assert gave_up > 50


def test_stream_model_window_stops_where_the_whole_run_agrees() -> None:
    rng = random.Random(6)
    for _ in range(200):
        n = rng.choice([1, 2, 3, 4, 8])
        rounds = round_sizes(rng.choice([n, n + 1, 2 * n, 3 * n + 1]), n)
        s_count = rng.randint(1, 16)
        slots = [rng.choice([0.01, 0.5, 1.0, 2.0, 3.7]) * rng.randint(1, 9) for _ in range(s_count)]
        waits = tuple(
            tuple(sorted(rng.sample(range(s_count), rng.randint(0, min(3, s_count))))) for _ in slots
        )
        shares = rng.choice([None, tuple(tuple(sorted(rng.sample(range(s_count), 1))) for _ in slots)])
        shape = _stream._structure(s_count, n, rounds, 4, waits, sharers=shares)
        _, whole = _stream._list_schedule(slots, shape)
        per = len(rounds) * s_count
        expected = (whole[shape.run_start[3 * per]] - whole[shape.run_start[per]]) / 2
        got = stream_ms(slots, n, rounds, iterations=4, window=(1, 3), weight_waits=waits, sharers=shares)
        assert got == expected


def all_bounded_steady_search(ticks: _search.Ticks, n: int, rounds: tuple[int, ...]) -> object:
    """`steady_search` as it was: every candidate cut and bounded, sorted, then timed in order."""
    fwd, fb, layers = ticks.fwd, ticks.fb, ticks.n
    total = fwd[layers] + fb[layers]
    chains = _candidates.EvenChains(ticks)
    lowest = max(n, ticks.probe(ticks.t_top)[0])
    found = []
    for s_count in range(lowest, max(3 * n, lowest + 2 * n) + 1):
        for p in range(layers - 1, ticks.p_mem - 1, -1):
            fused_t = fb[layers] - fb[p]
            if fused_t > _steady_search.STEADY_MAX_SPREAD * total / s_count:
                break
            for slots, stages in chains.plans(s_count, p):
                others = slots[: len(stages[0])] + slots[len(stages[0]) + 1 :]
                if (p and fused_t > max(others)) or max(slots) * len(
                    slots
                ) > _steady_search.STEADY_MAX_SPREAD * sum(slots):
                    continue
                found.append((steady_bound(slots, n, rounds), len(slots), p, slots, stages))
    found.sort(key=lambda c: c[:3])
    best, tie, plan = math.inf, (0, 0), None
    for bound, s_count, p, slots, stages in found:
        if bound > best * (1 + 1e-9):
            break
        period = steady_period(slots, n, rounds)
        if period < best * (1 - 1e-9) or (period <= best * (1 + 1e-9) and (s_count, p) < tie):
            best, tie, plan = period, (s_count, p), stages
    return plan


def test_lazy_steady_search_is_the_search_over_all_candidates() -> None:
    rng = random.Random(9)
    for _ in range(120):
        layers = rng.randint(2, 40)
        fwd = [rng.choice([0.0, 0.1, 0.5, 1.0, 1.0, 2.0]) for _ in range(layers)]
        fwd[0] = fwd[0] or 1.0
        bwd = [x * rng.choice([1.3, 2.0, 3.0]) for x in fwd]
        mem = [rng.randint(0, 5) for _ in fwd]
        cap = rng.choice([None, max(mem) + rng.randint(0, 10)])
        n = rng.choice([1, 2, 4, 8])
        rounds = round_sizes(rng.choice([n, 2 * n, 3 * n + 1]), n)
        rounds = rounds[:1] if len(set(rounds)) == 1 else rounds
        f, fb = _search.to_ticks(fwd, bwd)
        expected = all_bounded_steady_search(_search.Ticks(f, fb, mem, cap), n, rounds)
        assert _steady_search.steady_search(_search.Ticks(f, fb, mem, cap), n, rounds) == expected


def split_with_cover(
    pre: Sequence[int], stop: int, parts: int, reach: Sequence[int], *, larger_last: bool = False
) -> list[range] | None:
    """`balanced_split` as it was, with the parts each rest needs counted item by item.

    Items [0, stop) (prefix sums ``pre``, memory ``reach``) in exactly ``parts`` consecutive
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

    t, _ = _candidates._least_largest_part(pre, stop, parts, reach, nxt, count)
    if count(t) > parts:
        return None  # memory cuts the chain into more parts than asked for
    cover = [0] * (stop + 1)  # cover[i]: parts the rest [i, stop) needs at t (greedy is least)
    j = stop
    for i in range(stop - 1, -1, -1):  # nxt(i, t) only moves left as i does: one sweep
        while pre[j] - pre[i] > t:
            j -= 1
        r = reach[i]
        cover[i] = 1 + cover[j if j < r else r]

    def cut(targets: Sequence[float] | None) -> list[range]:
        """Left to right, each part as close as it can be to its target (default: an equal share
        of what is left) while the rest still fits in the parts left."""
        remaining = list(targets) if targets is not None else []
        out: list[range] = []
        i = 0
        for left in range(parts, 1, -1):
            j_max = min(bisect_right(pre, pre[i] + t, i + 1, stop + 1) - 1, reach[i], stop - left + 1)  # nxt
            j_min = i + 1
            while cover[j_min] >= left:
                j_min += 1  # a shorter part would leave the rest more than left-1 parts
            goal = remaining[0] if remaining else (pre[stop] - pre[i]) / left
            j = _candidates._nearest(pre, i, goal, j_min, j_max)
            if remaining:  # this part used up the target nearest to what it got
                del remaining[_candidates._nearest_target(remaining, pre[j] - pre[i], descending)]
            out.append(range(i, j))
            i = j
        out.append(range(i, stop))
        return out

    # Even parts first; then the same sizes again, in order (largest first, or last).
    descending = not larger_last
    even = cut(None)
    sizes = sorted((pre[r.stop] - pre[r.start] for r in even), reverse=not larger_last)
    return cut(sizes)


def test_balanced_split_is_the_split_that_counted_every_rest() -> None:
    rng = random.Random(10)
    for _ in range(300):
        layers = rng.randint(1, 50)
        fwd = [rng.choice([0.0, 0.1, 0.5, 1.0, 1.0, 2.0, 3.0]) for _ in range(layers)]
        bwd = [x * rng.choice([1.3, 2.0, 3.8]) for x in fwd]
        mem = [rng.randint(0, 6) for _ in fwd]
        ticks = _search.Ticks(
            *_search.to_ticks(fwd, bwd), mem, rng.choice([None, max(mem) + rng.randint(0, 12)])
        )
        for _ in range(5):
            pre, stop = rng.choice([ticks.fwd, ticks.fb]), rng.randint(1, layers)
            parts, larger_last = rng.randint(1, stop + 1), rng.random() < 0.5
            expected = split_with_cover(pre, stop, parts, ticks.reach, larger_last=larger_last)
            assert (
                _candidates.balanced_split(pre, stop, parts, ticks.reach, larger_last=larger_last) == expected
            )


def device_bound_run_by_run(slot_ms: tuple[float, ...], n: int, rounds: tuple[int, ...]) -> float:
    pre = [0.0]
    for ms in slot_ms:
        pre.append(pre[-1] + ms)
    work, head, tail = [0.0] * n, [math.inf] * n, [math.inf] * n
    k = 0
    for size in rounds:
        for i, ms in enumerate(slot_ms):
            d, k = k % n, k + 1
            work[d] += size * ms
            head[d] = min(head[d], pre[i])
            tail[d] = min(tail[d], pre[-1] - pre[i + 1])
    return max(work[d] + head[d] + tail[d] for d in range(n) if head[d] < math.inf) * (1 - 1e-6)


def test_device_bound_by_stride_is_run_by_run() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        n = rng.choice([1, 2, 3, 4, 5, 8])
        rounds = round_sizes(rng.choice([n, n + 1, 2 * n, 3 * n + 1]), n)
        slots = tuple(
            rng.choice([0.0, 0.01, 0.1, 0.5, 1.0, 3.7]) * rng.randint(1, 9) for _ in range(rng.randint(1, 30))
        )
        assert device_bound(slots, n, rounds) == device_bound_run_by_run(slots, n, rounds)


def structure_task_by_task(
    s_count: int, n: int, rounds: tuple[int, ...], iterations: int, waits: tuple[tuple[int, ...], ...] | None
) -> tuple[list[int], list[int], list[int], list[list[tuple[int, int]]]]:
    """The stream model's graph as `_stream._structure` built it before: (slot, device, unmet,
    dependents as (task, hops))."""
    slot: list[int] = []
    device: list[int] = []
    run_start: list[int] = []
    k = 0
    for _ in range(iterations):
        for size in rounds:
            for i in range(s_count):
                run_start.append(len(slot))
                slot.extend([i] * size)
                device.extend([k % n] * size)
                k += 1
    run_start.append(len(slot))
    unmet = [0] * len(slot)
    after: list[list[tuple[int, int]]] = [[] for _ in slot]
    for run in range(k):
        first, stop = run_start[run], run_start[run + 1]
        for t in range(first + 1, stop):
            after[t - 1].append((t, 0))
            unmet[t] += 1
        if run % s_count:
            for j in range(stop - first):
                after[run_start[run - 1] + j].append((first + j, 2))
                unmet[first + j] += 1
        if run >= 2 * n:
            after[run_start[run - 2 * n + 1] - 1].append((first, 1))
            unmet[first] += 1
    per = s_count * len(rounds)
    if waits is not None:
        for run in range(2 * per, k):
            base = (run // per - 2) * per
            for waited in waits[run % s_count]:
                for r in range(len(rounds)):
                    after[run_start[base + r * s_count + waited + 1] - 1].append((run_start[run], 5))
                    unmet[run_start[run]] += 1
    return slot, device, unmet, after


def test_stream_graph_by_runs_is_the_graph_task_by_task() -> None:
    rng = random.Random(12)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 4, 8])
        rounds = round_sizes(rng.choice([n, n + 1, 2 * n, 3 * n + 1]), n)
        s_count, iterations = rng.randint(1, 16), rng.choice([1, 2, 4])
        waits = rng.choice(
            [
                None,
                tuple(
                    tuple(sorted(rng.sample(range(s_count), rng.randint(0, min(2, s_count)))))
                    for _ in range(s_count)
                ),
            ]
        )
        bare = _stream._runs_structure(s_count, n, rounds, iterations)
        for base in (None, bare):
            shape = _stream._structure(s_count, n, rounds, iterations, waits, base=base)
            slot, device, unmet, after = structure_task_by_task(s_count, n, rounds, iterations, waits)
            assert (shape.slot, shape.device, list(shape.unmet)) == (slot, device, unmet)
            k = shape.count
            assert [sorted(divmod(code, k)[::-1] for code in a) for a in shape.after] == [
                sorted((u, hops) for u, hops in a) for a in after
            ]
            assert shape.ready == [[t for t in range(k) if not unmet[t] and device[t] == d] for d in range(n)]
        assert bare.unmet == structure_task_by_task(s_count, n, rounds, iterations, None)[2]  # not changed


def random_even_plans(rng: random.Random, count: int) -> list[tuple[LayerCosts, Plan, int, tuple[int, ...]]]:
    """Even plans (chains cut by `EvenChains`) over random costs, with (N, rounds) to model them."""
    out: list[tuple[LayerCosts, Plan, int, tuple[int, ...]]] = []
    while len(out) < count:
        layers = rng.randint(2, 16)
        fwd = tuple(rng.choice([0.01, 0.5, 1.0, 2.0, 3.7]) for _ in range(layers))
        costs = LayerCosts(fwd, tuple(f * rng.choice([1.0, 1.3, 2.0, 3.8]) for f in fwd), (0,) * layers)
        n = rng.choice([1, 2, 3, 4, 8])
        m = rng.choice([n, n + 1, 2 * n, 3 * n + 1])
        p = rng.randrange(layers)
        for _, stages in chains_of(costs).plans(rng.randint(1, 2 * p + 1), p):
            out.append((costs, even_plan(*stages, costs, n, m), n, round_sizes(m, n)))
    return out


def test_split_bounds_never_exceed_the_split_model() -> None:
    """`device_bound` with `Split.heads`/`Split.tails` is a lower bound of `split_ms`, and the
    shared bound's fill (`_StageTimes.split_fill`) is the sum of those heads and tails."""
    for costs, plan, n, rounds in random_even_plans(random.Random(21), 400):
        times = _StageTimes(costs)
        split = times.split(plan.fwd_stages, plan.fused, plan.bwd_stages)
        heads, tails = split.heads(plan.slot_ms), split.tails(plan.slot_ms)
        model = split_ms(plan.slot_ms, split, n, rounds)
        assert device_bound(plan.slot_ms, n, rounds, heads, tails) <= model
        s = plan.num_slots
        fill = sum(heads[d] + tails[s - 1 - d] for d in range(min(n, s)))
        assert times.split_fill(plan.fwd_stages, plan.bwd_stages, plan.slot_ms, n) == pytest.approx(fill)


def test_split_model_gives_up_only_past_its_bound() -> None:
    gave_up = 0
    rng = random.Random(22)
    for costs, plan, n, rounds in random_even_plans(rng, 400):
        split = _StageTimes(costs).split(plan.fwd_stages, plan.fused, plan.bwd_stages)
        full = split_ms(plan.slot_ms, split, n, rounds)
        bound = full * rng.choice([0.9, 0.99, 1.0, 1.01])
        cut = split_ms(plan.slot_ms, split, n, rounds, give_up=bound)
        assert cut == full or (cut == math.inf and full > bound)
        gave_up += cut == math.inf
    assert gave_up > 50


def test_modelling_the_proxies_first_ranks_the_same() -> None:
    """`_rank`'s ``first``: plans modelled ahead of the bound order change what is pruned, never
    the first ``reads`` plans (each pruned plan was past a modelled ``keep``-th best)."""
    for layers, ratio, head, n, m in [(24, 2.0, 3.0, 4, 8), (28, 1.3, 1.0, 8, 16), (12, 3.8, 4.0, 2, 4)]:
        costs = grid_costs(layers, ratio, head)
        times = _StageTimes(costs)
        chains = chains_of(costs)
        proxy = partition(costs, n, m)
        plans = [_Candidate(proxy)]
        for _, stages in _candidates.neighbourhood(chains, proxy.num_slots, proxy.fused.start, 3, 3):
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            plans.append(_Candidate(None, key, times.of(*key), n, m))
        rounds = round_sizes(m, n)
        for keep in (1, 2, 4):
            ranked = [_rank(plans, n, rounds, False, keep, reads=keep, times=times, first=f) for f in (0, 1)]
            assert ranked[0][:keep] == ranked[1][:keep]


@pytest.mark.parametrize(
    "mode",
    [{}, {"loop": True}, {"loop": True, "longer": True}, {"loop": True, "late": True}],
    ids=["chained", "loop", "loop-longer", "loop-one-loss-late"],
)
def test_async_rankings_pruned_by_their_bounds_rank_the_same_first(mode: dict[str, bool]) -> None:
    """`_rank` skips a plan whose bound is past the ``keep``-th best so far; each async model's
    bound must be one. A loop one loss late submits iteration t + 2 after iteration t's losses,
    so its gate bounds two iterations, not one: with the waiting loop's bound there, 6 of these
    15 rankings lose a plan from their first ``keep``."""
    for layers, ratio, head, n, m in [
        (24, 2.0, 3.0, 4, 8),
        (28, 1.3, 1.0, 8, 16),
        (12, 3.8, 4.0, 2, 4),
        (24, 3.8, 1.0, 8, 16),
        (32, 2.5, 4.0, 8, 16),
    ]:
        costs = grid_costs(layers, ratio, head)
        times = _StageTimes(costs)
        chains = chains_of(costs)
        plans: dict[object, _Candidate] = {}
        for _, stages in _candidates.balanced_fused(chains, range(1, 2 * n + 1), 2):
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            plans[key] = _Candidate(None, key, times.of(*key), n, m)
        candidates = list(plans.values())
        rounds = round_sizes(m, n)
        every = _rank(
            candidates, n, rounds, True, len(candidates), reads=len(candidates), times=times, **mode
        )
        for keep in (1, 2, 4):
            pruned = _rank(candidates, n, rounds, True, keep, reads=keep, times=times, **mode)
            assert [(round(ms, 9), p) for ms, p in pruned[:keep]] == [
                (round(ms, 9), p) for ms, p in every[:keep]
            ]


@pytest.mark.parametrize("late", [False, True], ids=["waiting-loop", "loop-one-loss-late"])
def test_timing_the_best_modelled_first_spares_the_proxies_plan(late: bool) -> None:
    """`choose_plan` times its few best-modelled first: the floor (busiest device) of the first
    figure spares the proxies' plan here (8 slots, timed first before), and the choice is the
    one timing every plan makes (an evaluator without a floor)."""
    costs = grid_costs(24, 1.3, 4.0)
    evaluate = (
        late_loop_evaluator(costs, 8, 16) if late else engine_evaluator(costs, 8, 16, async_optimizer=True)
    )
    timed: list[object] = []

    def recorded(plan: Plan) -> float:
        timed.append(_stages(plan))
        return evaluate(plan)

    floored = EstimatingEvaluator(recorded, evaluate.floor, evaluate.estimate)  # type: ignore[attr-defined]
    options = {"async_optimizer": True, "late": late, "refine": False}
    chosen = choose_plan(costs, 8, 16, evaluate=floored, **options)  # type: ignore[arg-type]
    proxies = choose_plan(costs, 8, 16, **options)  # type: ignore[arg-type]
    assert proxies.num_slots == 8 and _stages(proxies) not in timed
    assert chosen == choose_plan(costs, 8, 16, evaluate=lambda plan: evaluate(plan), **options)  # type: ignore[arg-type]
