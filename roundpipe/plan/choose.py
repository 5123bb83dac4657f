"""Which plan a run uses: one entry point for the pipe, the CLI and the benchmarks.

`partition` answers two precise questions: the exact optimum of the t_max objective (fast, any
size), and with ``steady=True`` the best plan under the steady-state model of async round-robin
dispatch. Both are proxies: several plans share a t_max optimum and round-robin stalls on uneven
ones, and the steady model can be wrong on shapes it was not checked on. So when the caller gives
an ``evaluate`` function (ms per iteration of a plan, e.g. `roundpipe.plan_eval.engine_evaluator`:
the real engine on the fake backend), `choose_plan` generates candidates around the proxies' plans
(slot counts and fused stages nearby, chains cut evenly), ranks them with a fast model of the
stream (`_split_stream.split_ms` for sync runs, `_stream.stream_ms` for async), evaluates the best few
exactly and runs the fastest; equal times go to the more even plan. Without ``evaluate`` it keeps the proxies' choice.

Pure: no torch, no devices, no scheduler (the evaluator is passed in).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Sequence

from roundpipe.plan import _candidates, _search, _split_stream, _stream
from roundpipe.plan._split_stream import Split, split_ms
from roundpipe.plan._stream import stream_ms, weight_waits
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

MODEL_ITERATIONS, MODEL_WINDOW = 4, (1, 3)
"""Async ranking: the modelled time per iteration between iterations 1 and 3 of a chained run."""

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
) -> Plan:
    """The plan to run.

    Without ``evaluate``: `partition`'s objective optimum, or for an async run the better of it and
    the steady-state plan by `steady_iteration_ms` (ties keep the objective optimum). With
    ``evaluate`` (ms per iteration of a plan): the least evaluated time among the proxies' choice
    and the best-modelled candidates, ``evaluations`` plans in all (at least 2; default by size,
    see `default_evaluations`); up to EVALUATE_MAX_LAYERS layers, beyond which the proxies decide.
    """
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
    ranked, extra = _ranked_candidates(costs, proxies, chains, rounds, async_optimizer, max(count, 2))
    # The proxies' choice always runs in the comparison: evaluation never does worse than it.
    chosen = {_stages(proxies[0]): proxies[0]}
    for _, plan in ranked:
        if len(chosen) >= max(count, 2):
            break
        chosen.setdefault(_stages(plan), plan)
    if extra and (not ranked or extra[0][0] < ranked[0][0]):
        chosen.setdefault(_stages(extra[0][1]), extra[0][1])  # see `_ranked_candidates`
    timed = [(evaluate(p), p) for p in chosen.values()]
    best_ms = min(ms for ms, _ in timed)
    ties = [p for ms, p in timed if ms <= best_ms * (1 + 1e-9)]
    return min(ties, key=lambda p: (spread(p), p.num_slots, -len(p.fused)))


def default_evaluations(plan: Plan, num_microbatches: int, iterations: int) -> int:
    """How many plans the engine times (the proxies' choice and the best-modelled candidates):
    fewer as their runs grow (S*M computes per iteration), so that choosing stays short."""
    computes = plan.num_slots * num_microbatches * iterations
    return max(2, min(4, 1200 // max(computes, 1)))


def spread(plan: Plan | _Candidate) -> float:
    """How uneven a plan is: its slowest slot over its mean slot (1 is perfectly even)."""
    mean = math.fsum(plan.slot_ms) / plan.num_slots
    return plan.t_max / mean if mean > 0 else 1.0


def _stages(plan: Plan) -> tuple[tuple[range, ...], range, tuple[range, ...]]:
    return plan.fwd_stages, plan.fused, plan.bwd_stages


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
) -> tuple[list[tuple[float, Plan]], list[tuple[float, Plan]]]:
    """Even plans around each proxy plan (and the proxies), best modelled first; and apart, the
    best modelled of the even plans with N+1 to 2N slots and a fused stage about the mean slot.

    Those wider plans (a 1-3 layer fused stage, stages a little shorter than with N slots) are the
    fastest on several grid shapes (up to 11% faster than the others), but the ranking model is
    off by up to 20% on async plans: ranked with the rest they displace, on other shapes, the plan
    the engine prefers. So the best of them is timed in addition, and only when the model puts it
    first of all. ``needed``: how many of the ranked plans the caller reads, best first."""
    n, m = proxies[0].num_devices, proxies[0].num_microbatches
    plans = {_stages(p): _Candidate(p) for p in proxies}
    around = (
        _candidates.neighbourhood(chains, proxy.num_slots, proxy.fused.start, SLOT_REACH, FUSED_REACH)
        for proxy in proxies
    )
    few_slots = _candidates.balanced_fused(chains, range(1, n + 1))
    times = _StageTimes(costs)
    for family in (*around, few_slots):
        for _, stages in family:
            key = (tuple(stages[0]), stages[1], tuple(stages[2]))
            if key not in plans:
                plans[key] = _Candidate(None, key, times.of(*key), n, m)
    wider: dict[object, _Candidate] = {}
    for _, stages in _candidates.balanced_fused(chains, range(n + 1, 2 * n + 1)):
        key = (tuple(stages[0]), stages[1], tuple(stages[2]))
        if key not in plans and key not in wider:
            wider[key] = _Candidate(None, key, times.of(*key), n, m)
    # Sync bounds are meant as true lower bounds of the model, so that the first ``needed`` are
    # exact with ``keep=needed`` (they are not quite: see `_rank`'s shared bound); the async
    # window's time per iteration can fall under its bound (iterations overlap), so there the
    # margin of 4 stays.
    keep = 4 if async_optimizer else needed
    ranked = _rank(
        list(plans.values()),
        *(n, rounds, async_optimizer),
        keep=keep,
        reads=max(keep, needed),
        times=times,
        # Sync: the proxies first (a good plan, whose time then prunes the rest sooner: 3 of 40 ms
        # at 94 layers); the order changes what is pruned, not the first ``reads`` (see `_rank`).
        first=0 if async_optimizer else len(proxies),
    )
    # With sync bounds (as above) a wider plan whose bound is past the best modelled plan above
    # could not be timed (see `choose_plan`), so it need not be modelled.
    cutoff = ranked[0][0] if ranked and not async_optimizer else math.inf
    extra = _rank(list(wider.values()), n, rounds, async_optimizer, keep=1, cutoff=cutoff, times=times)
    return ranked, extra[:1]


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


class _StageTimes:
    """Slot times of even plans as `Plan.stage_ms` sums them, each stage summed once: candidates
    share most of their stages."""

    def __init__(self, costs: LayerCosts) -> None:
        self.fwd_ms, self.bwd_ms = costs.fwd_ms, costs.bwd_ms
        self.sums: dict[tuple[bool, int, int], float] = {}

    def stage(self, r: range, backward: bool) -> float:
        key = (backward, r.start, r.stop)
        if key not in self.sums:
            ms = math.fsum(self.fwd_ms[r.start : r.stop])
            self.sums[key] = ms + math.fsum(self.bwd_ms[r.start : r.stop]) if backward else ms
        return self.sums[key]

    def of(self, fwd: tuple[range, ...], fused: range, bwd: tuple[range, ...]) -> tuple[float, ...]:
        return tuple([self.stage(r, False) for r in fwd] + [self.stage(r, True) for r in (fused, *bwd)])

    def split_fill(
        self, fwd: tuple[range, ...], bwd: tuple[range, ...], slot_ms: tuple[float, ...], num_devices: int
    ) -> float:
        """``sum(heads[d] + tails[S - 1 - d] for d < min(N, S))`` of `split` (`Split.heads`,
        `Split.tails`) without the rest of them: every candidate's shared sync bound needs it."""
        s_count, first_backward = len(slot_ms), len(fwd) + 1
        count = min(num_devices, s_count)
        pre = [0.0]  # as `Split.heads` adds them
        for ms in slot_ms[: first_backward if count > first_backward else count]:
            pre.append(pre[-1] + ms)
        fill = 0.0
        for d in range(count):
            if d < first_backward:
                fill += pre[d]
            elif (r := bwd[d - first_backward]).start > 0:  # rare: fewer forward slots than devices
                fill += pre[bisect_left([f.stop for f in fwd], r.start) + 1]
        tail = 0.0
        for i in range(s_count - 1, s_count - count, -1):  # tails[i - 1], from the last slot down
            tail += slot_ms[i] - (self.stage(bwd[i - first_backward], False) if i >= first_backward else 0.0)
            fill += tail
        return fill

    def split(self, fwd: tuple[range, ...], fused: range, bwd: tuple[range, ...]) -> Split:
        """What `split_ms` needs of the plan besides its slot times."""
        stops = [r.stop for r in fwd]
        return Split(
            len(fwd) + 1,
            [0.0] * (len(fwd) + 1) + [self.stage(r, False) for r in bwd],
            # the forward stage that saved the activation entering r: the first to end at or past it
            [-1] * (len(fwd) + 1) + [bisect_left(stops, r.start) if r.start > 0 else -1 for r in bwd],
            [len(r) for r in (*fwd, fused, *bwd)],
        )


class _Candidate:
    """A plan to rank: its stages and slot times, the `Plan` itself built only if it is modelled
    (most candidates are pruned by their bound, and building a plan checks all of it)."""

    __slots__ = (
        "_plan",
        "bwd_stages",
        "fused",
        "fwd_stages",
        "num_devices",
        "num_microbatches",
        "slot_ms",
        "t_max",
    )

    def __init__(
        self,
        plan: Plan | None,
        stages: tuple[tuple[range, ...], range, tuple[range, ...]] | None = None,
        slot_ms: tuple[float, ...] = (),
        num_devices: int = 0,
        num_microbatches: int = 0,
    ) -> None:
        self._plan = plan
        if plan is not None:
            stages, slot_ms = _stages(plan), plan.slot_ms
            num_devices, num_microbatches = plan.num_devices, plan.num_microbatches
        assert stages is not None
        self.fwd_stages, self.fused, self.bwd_stages = stages
        self.slot_ms = slot_ms
        self.t_max = plan.t_max if plan is not None else max(slot_ms)
        self.num_devices, self.num_microbatches = num_devices, num_microbatches

    @property
    def num_slots(self) -> int:
        return len(self.fwd_stages) + 1 + len(self.bwd_stages)

    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = Plan(
                *(self.fwd_stages, self.fused, self.bwd_stages, self.t_max),
                *(self.num_devices, self.num_microbatches, self.slot_ms),
            )
        return self._plan


def _rank(
    plans: list[_Candidate],
    num_devices: int,
    rounds: tuple[int, ...],
    async_optimizer: bool,
    keep: int,
    cutoff: float = math.inf,
    reads: int = 0,
    times: _StageTimes | None = None,
    first: int = 0,
) -> list[tuple[float, Plan]]:
    """``plans`` with their modelled times, best first, in order of a lower bound: a plan whose
    bound is past the ``keep``-th best modelled time so far, or past ``cutoff``, is not modelled
    (4: as many as may be evaluated). The caller reads only the first ``reads`` (at least
    ``keep``): a plan the model shows on its way to be past the ``reads``-th best so far (or the
    cutoff) is left out as well. It could be none of them, and as it is past the ``keep``-th best
    too, its time would change no later pruning: the first ``reads`` are those of modelling every
    plan to the end. The first ``first`` plans are modelled before the others, whatever their
    bound: a plan is still pruned only past a modelled ``keep``-th best, so the first ``reads``
    are the same.

    Sync plans with ``times`` are modelled by `split_ms` (a backward stage's recompute ahead of
    its gradient, as the engine runs it: the whole-microbatch `stream_ms` is up to 16% slow on
    plans whose backward runs wait for gradients, and often left the engine's best out of the few
    timed), and bounded for it."""
    n = num_devices
    m = sum(rounds)
    splits: dict[int, Split] = {}  # by id of the candidate: sync plans with ``times``

    def split_of(p: _Candidate) -> Split | None:
        if async_optimizer or times is None:
            return None
        if id(p) not in splits:
            splits[id(p)] = times.split(p.fwd_stages, p.fused, p.bwd_stages)
        return splits[id(p)]

    def shared(p: _Candidate) -> float:
        work = m * math.fsum(p.slot_ms) / n  # every device's share of the work
        if async_optimizer:
            return work
        s = p.slot_ms
        if times is None:
            fill = sum(math.fsum(s[:d]) + math.fsum(s[len(s) - d :]) for d in range(min(n, len(s))))
        else:  # `split_ms`: `Split.heads` of the first N slots, `Split.tails` of the last N
            fill = times.split_fill(p.fwd_stages, p.bwd_stages, s, n)
        # device d starts after d slots and stops d slots before the end. Not a true lower bound
        # with S < 2N slots and several rounds (a later round's first slots can start at time 0
        # on a device whose first round-0 slot comes later), so the order of the plans decides
        # what it prunes there; kept as it is: bounding exactly changes 2 of the profile grid's
        # sync choices (28 layers bwd 3.8x head 4x: 430.8 -> 430.6 ms; 32/2.0/4: 339.3 -> 346.0)
        return work + fill / n

    def bound(p: _Candidate, least: float) -> float:  # ``least``: shared(p)
        if async_optimizer:
            return least
        split = split_of(p)
        if split is None:
            return max(least, device_bound(p.slot_ms, n, rounds))
        return max(least, device_bound(p.slot_ms, n, rounds, split.heads(p.slot_ms), split.tails(p.slot_ms)))

    modelled: list[tuple[float, float, int, _Candidate]] = []
    shapes: dict[object, _stream.Shape] = {}  # plans of one slot count share a task graph
    graphs: dict[object, _split_stream.SplitGraph] = {}  # so do split models (`split_ms`)
    reads = max(reads, keep)
    best: list[float] = []  # every modelled time so far, ascending
    for lower, i, p in _by_bound(plans, shared, bound, first=first):
        kept = best[keep - 1] if len(best) >= keep else math.inf
        if lower > min(kept, cutoff) * (1 + 1e-9):
            break
        give_up = min(best[reads - 1] if len(best) >= reads else math.inf, cutoff)
        if async_optimizer:
            waits = weight_waits(p.fwd_stages, p.fused, p.bwd_stages)
            ms = stream_ms(
                p.slot_ms,
                n,
                rounds,
                iterations=MODEL_ITERATIONS,
                window=MODEL_WINDOW,
                weight_waits=waits,
                give_up=give_up,
                shapes=shapes,
            )
        elif (split := split_of(p)) is not None:
            ms = split_ms(p.slot_ms, split, n, rounds, give_up=give_up, graphs=graphs)
        else:
            ms = stream_ms(p.slot_ms, n, rounds, give_up=give_up, shapes=shapes)
        if ms == math.inf:
            continue  # past the reads-th best (or the cutoff): modelled only as far as that shows
        modelled.append((ms, spread(p), i, p))
        insort(best, ms)
    modelled.sort(key=lambda x: x[:3])
    return [(x[0], x[3].plan()) for x in modelled]


def _by_bound(
    plans: list[_Candidate],
    least: Callable[[_Candidate], float],
    bound: Callable[[_Candidate, float], float],
    first: int = 0,
) -> Iterator[tuple[float, int, _Candidate]]:
    """``sorted((bound(p, least(p)), i, p) for i, p in enumerate(plans))``, lazily: ``bound`` (at
    least ``least``) is taken only for the plans the caller reaches, as a plan waits in the heap
    under ``least`` until it comes first (then under its bound, which is no less: it comes out in
    its place). `_rank` stops early; a sync bound's `device_bound` costs more than the rest.
    The first ``first`` plans come out first, in their order (each with its bound)."""
    for i, p in enumerate(plans[:first]):
        value = least(p)
        yield bound(p, value), i, p
    heap = [(least(p), i, False, p) for i, p in enumerate(plans) if i >= first]
    heapq.heapify(heap)
    while heap:
        value, i, done, p = heapq.heappop(heap)
        if done:
            yield value, i, p
        else:
            heapq.heappush(heap, (bound(p, value), i, True, p))


def device_bound(
    slot_ms: tuple[float, ...],
    num_devices: int,
    rounds: tuple[int, ...],
    heads: Sequence[float] | None = None,
    tails: Sequence[float] | None = None,
) -> float:
    """A lower bound of the sync `stream_ms` (one iteration), per device: its runs' work, plus
    the least time before any of them can start (a microbatch reaches slot i after slots 0..i-1)
    and after any of them ends (it still goes through the slots after i). Run k of the stream
    goes to device k mod N. Few slots (S < N) leave most of the work on a few devices, which the
    shared bound above does not see: with it, `_rank` models those plans first and late prunes.
    With ``heads`` and ``tails`` (`Split.heads`, `Split.tails`: per slot, the least time before
    its first task and after its last) the same bound of `split_ms`."""
    pre = [0.0]
    for ms in slot_ms:
        pre.append(pre[-1] + ms)
    total = pre[-1]
    work = [0.0] * num_devices
    head = [math.inf] * num_devices
    tail = [math.inf] * num_devices
    n, s_count, k = num_devices, len(slot_ms), 0
    for size in rounds:  # device d runs slots first, first + N, ... of the round (k: its first run)
        for d in range(n):
            first = (d - k) % n
            if first >= s_count:
                continue
            w = work[d]
            for ms in slot_ms[first::n]:  # in run order, as the runs are added up one by one
                w += size * ms
            work[d] = w
            last = first + (s_count - 1 - first) // n * n
            if heads is None or tails is None:
                head[d] = min(head[d], pre[first])  # prefix sums never fall: the first slot is least
                tail[d] = min(tail[d], total - pre[last + 1])
            else:  # a backward slot's head can be less than an earlier slot's; tails never rise
                head[d] = min(head[d], *heads[first::n])
                tail[d] = min(tail[d], tails[last])
        k += s_count
    busy = [d for d in range(num_devices) if head[d] < math.inf]
    # Float sums: shaded by a millionth so that rounding never lifts the bound over the model.
    return max(work[d] + head[d] + tail[d] for d in busy) * (1 - 1e-6)
