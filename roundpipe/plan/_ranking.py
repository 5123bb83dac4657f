"""How `choose_plan` ranks its candidates before the evaluator times the best few.

Why apart from `choose`: the ranking is its own algorithm (a candidate's stage times, the stream
models of `_stream` and `_split_stream` run over them, and the lower bounds that let most
candidates be dropped without being modelled to the end), and every shortcut in it must leave the
ranking the caller reads unchanged, which its tests check on their own. `choose` generates the
candidates and decides; this module only orders them.

Pure: no torch, no devices, no scheduler.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Sequence

from roundpipe.plan import _split_stream
from roundpipe.plan._sharing import sharers_and_waits
from roundpipe.plan._split_stream import Split, split_ms
from roundpipe.plan._stream import stream_ms
from roundpipe.plan._stream_graph import Shape
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import busiest_device_share
from roundpipe.plan.partition import Plan

MODEL_ITERATIONS, MODEL_WINDOW = 4, (1, 3)
"""Async ranking: the modelled time per iteration between iterations 1 and 3 of a chained run."""
LOOP_MODEL_ITERATIONS, LOOP_MODEL_WINDOW = 4, (1, 3)
"""Async ranking with ``loop`` (a run submitted as a training loop submits it): iterations 1 to 3
of 4. The evaluator reads the settled time (`roundpipe.planning.replay.settled_ms`), which no short
window gives; with the busiest device's floor this window ranks as well as iterations 1 to 5 of
6 (the chosen plans' settled times within 0.1%) and costs a third less, which pays for ranking
every candidate this way (`choose_plan`)."""
LONG_LOOP_MODEL_ITERATIONS, LONG_LOOP_MODEL_WINDOW = 5, (2, 4)
"""Async ranking with ``loop`` and ``longer``: iterations 2 to 4 of 5, past the first
iteration after the fill, which on some plans still runs slow. It ranks the fastest plan of
the (8, 16) grid shape of 32 layers, backward 3.8x and head 4x 4th of all even plans (the
window of 1 to 3: 19th), but as the only ranking it chooses worse on 23 of the 288 async grid
shapes (most at (4, 8): the model is about 6% off there with either window), so it re-orders
only the plans just past the shortlist (`choose.RECHECKED`)."""
LATE_MODEL_ITERATIONS, LATE_MODEL_WINDOW = 10, (3, 9)
"""Async ranking with ``late`` (a loop that reads each loss one iteration late: iteration t + 2
submitted once iteration t's fused runs are done): iterations 3 to 9 of 10. Plans of up to N
slots submitted that way settle only after a few slow iterations: on the 24-layer grid shape of
backward 1.3x and head 3x the fastest (7 slots, 172.77 ms settled) reads 253 ms over iterations
1 to 3. Over every even plan of up to N slots on the 48 (8, 16) grid shapes of 24-32 layers, the
faster of this window's best two is 0.39-0.54% slower than the fastest on the mean, which it
ranks 7th at worst; 3 to 7 of 8 gives 4.1-4.6% (the fastest as low as 31st), 3 to 11 of 12 ranks
as well as 3 to 9, 3 to 13 of 14 no better (`python bench/schedule.py --exhaustive --loss-lag
1`)."""


def spread(plan: Plan | _Candidate) -> float:
    """How uneven a plan is: its slowest slot over its mean slot (1 is perfectly even)."""
    mean = math.fsum(plan.slot_ms) / plan.num_slots
    return plan.t_max / mean if mean > 0 else 1.0


def _stages(plan: Plan) -> tuple[tuple[range, ...], range, tuple[range, ...]]:
    return plan.fwd_stages, plan.fused, plan.bwd_stages


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
    *,
    times: _StageTimes,
    first: int = 0,
    loop: bool = False,
    late: bool = False,
    longer: bool = False,
    shapes: dict[object, Shape] | None = None,
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

    Async plans are modelled by `stream_ms` over a window of chained iterations, or (``loop``)
    of iterations each submitted once the previous one's fused runs are done, as a training loop
    submits them (``longer``: over `LONG_LOOP_MODEL_WINDOW`), or (``loop`` and ``late``) once
    those of the one before it are, as a loop that reads each loss one iteration late submits
    them. Sync plans are modelled by `split_ms` (a backward stage's recompute ahead of
    its gradient, as the engine runs it: the whole-microbatch `stream_ms` is up to 16% slow on
    plans whose backward runs wait for gradients, and often left the engine's best out of the few
    timed), and bounded for it."""
    model = _Model(times, num_devices, rounds, async_optimizer, loop, late, longer, shapes)
    modelled: list[tuple[float, float, int, _Candidate]] = []
    reads = max(reads, keep)
    best: list[float] = []  # every modelled time so far, ascending
    for lower, i, p in _by_bound(plans, model.shared, model.bound, first=first):
        kept = best[keep - 1] if len(best) >= keep else math.inf
        if lower > min(kept, cutoff) * (1 + 1e-9):
            break
        ms = model.ms(p, give_up=min(best[reads - 1] if len(best) >= reads else math.inf, cutoff))
        if ms == math.inf:
            continue  # past the reads-th best (or the cutoff): modelled only as far as that shows
        modelled.append((ms, spread(p), i, p))
        insort(best, ms)
    modelled.sort(key=lambda x: x[:3])
    return [(x[0], x[3].plan()) for x in modelled]


def _window(loop: bool, late: bool, longer: bool) -> tuple[int, tuple[int, int]]:
    """The iterations an async ranking models and the window it reads (see `_rank`)."""
    if late:
        return LATE_MODEL_ITERATIONS, LATE_MODEL_WINDOW
    if loop and longer:
        return LONG_LOOP_MODEL_ITERATIONS, LONG_LOOP_MODEL_WINDOW
    return (LOOP_MODEL_ITERATIONS, LOOP_MODEL_WINDOW) if loop else (MODEL_ITERATIONS, MODEL_WINDOW)


class _Model:
    """One ranking's model of a candidate's time (`_rank`) and the lower bounds of it that let
    most candidates be dropped unmodelled, with what they share across candidates: the split
    models of sync plans, the busiest device's share of async ones, the task graphs of both."""

    def __init__(
        self,
        times: _StageTimes,
        num_devices: int,
        rounds: tuple[int, ...],
        async_optimizer: bool,
        loop: bool,
        late: bool,
        longer: bool,
        shapes: dict[object, Shape] | None,
    ) -> None:
        self.times, self.n, self.rounds = times, num_devices, rounds
        self.m, self.largest_round = sum(rounds), max(rounds)
        self.async_optimizer, self.loop, self.late = async_optimizer, loop, late
        self.iterations, self.window = _window(loop, late, longer)
        self.splits: dict[int, Split] = {}  # by id of the candidate (sync plans)
        self.floors: dict[int, float] = {}  # by id of the candidate (async plans)
        # plans of one slot count share a task graph (the caller's, if it ranks again)
        self.shapes: dict[object, Shape] = {} if shapes is None else shapes
        self.graphs: dict[object, _split_stream.SplitGraph] = {}  # so do split models (`split_ms`)

    def split_of(self, p: _Candidate) -> Split:
        if id(p) not in self.splits:
            self.splits[id(p)] = self.times.split(p.fwd_stages, p.fused, p.bwd_stages)
        return self.splits[id(p)]

    def shared(self, p: _Candidate) -> float:
        """The least time of any plan given its work alone, shared evenly by the devices."""
        n = self.n
        work = self.m * math.fsum(p.slot_ms) / n  # every device's share of the work
        if self.async_optimizer and self.loop:
            # A loop submits iteration t + 1 once iteration t's fused runs are done, and a fused run
            # computes its round's microbatches one after the other, the first once it has been
            # through the forward slots: no iteration is shorter than that.
            f = len(p.fwd_stages)
            return max(work, (math.fsum(p.slot_ms[:f]) + self.largest_round * p.slot_ms[f]) / (1 + self.late))
        if self.async_optimizer:
            return work
        # `split_ms`: `Split.heads` of the first N slots, `Split.tails` of the last N
        fill = self.times.split_fill(p.fwd_stages, p.bwd_stages, p.slot_ms, n)
        # device d starts after d slots and stops d slots before the end. Not a true lower bound
        # with S < 2N slots and several rounds (a later round's first slots can start at time 0
        # on a device whose first round-0 slot comes later), so the order of the plans decides
        # what it prunes there; kept as it is: bounding exactly changes 2 of the profile grid's
        # sync choices (28 layers bwd 3.8x head 4x: 430.8 -> 430.6 ms; 32/2.0/4: 339.3 -> 346.0)
        return work + fill / n

    def floor(self, p: _Candidate) -> float:
        # A loop's evaluation never reads less than the busiest device's share (`settled_ms`),
        # and round-robin can give one device much more than the mean: a model's window cannot
        # see the backlog that builds there over tens of iterations.
        if id(p) not in self.floors:
            self.floors[id(p)] = busiest_device_share(p.slot_ms, self.n, self.rounds)
        return self.floors[id(p)]

    def bound(self, p: _Candidate, least: float) -> float:  # ``least``: shared(p)
        if self.async_optimizer:
            return max(least, self.floor(p))
        split = self.split_of(p)
        heads, tails = split.heads(p.slot_ms), split.tails(p.slot_ms)
        return max(least, device_bound(p.slot_ms, self.n, self.rounds, heads, tails))

    def ms(self, p: _Candidate, give_up: float) -> float:
        """``p``'s modelled time, or inf once it shows to be past ``give_up``."""
        if not self.async_optimizer:
            return split_ms(
                p.slot_ms, self.split_of(p), self.n, self.rounds, give_up=give_up, graphs=self.graphs
            )
        shares, waits = sharers_and_waits(p.fwd_stages, p.fused, p.bwd_stages)
        ms = stream_ms(
            p.slot_ms,
            self.n,
            self.rounds,
            iterations=self.iterations,
            window=self.window,
            weight_waits=waits,
            sharers=shares,
            give_up=give_up,
            shapes=self.shapes,
            gate=len(p.fwd_stages) if self.loop else None,
            gate_lag=int(self.late),
        )
        return max(ms, self.floor(p))


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
    if heads is None or tails is None:  # `stream_ms`: a microbatch goes through every slot in turn
        heads, tails = pre[:-1], [total - after for after in pre[1:]]
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
            # A backward slot's head can be less than an earlier slot's; tails never rise.
            head[d] = min(head[d], *heads[first::n])
            tail[d] = min(tail[d], tails[last])
        k += s_count
    busy = [d for d in range(num_devices) if head[d] < math.inf]
    # Float sums: shaded by a millionth so that rounding never lifts the bound over the model.
    return max(work[d] + head[d] + tail[d] for d in busy) * (1 - 1e-6)
