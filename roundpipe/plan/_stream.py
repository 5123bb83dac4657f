"""A fast model of the round-robin stream: the compute tasks of a plan, list-scheduled per device.

`choose_plan` ranks its candidate plans with it before the engine evaluates the best few, so it
must be cheap: one heap event per microbatch of each stage run, no transfers, no optimizer. It
mirrors the engine's compute lanes: run k of the stream (slot k mod S of its round) goes to device
k mod N; microbatch j of a run is ready when the run's microbatch j-1 is done, microbatch j has
left the previous slot, (prefetch of one stage) the device's run k-2N has ended and (async) the
gradients of its layers two iterations back are in and so are the previous iteration's uploads of
its layers (the P-copy that brings its weights in overwrites what they read); a free device
starts its ready task that comes first in dispatch order. It is a model, not the engine: the
engine's graphs can hold more (transfers, a backward stage's recompute ahead of its gradient),
which is why the engine has the last word.

Sync plans are ranked by `split_ms` (`roundpipe/plan/_split_stream.py`): the same list schedule
with a backward microbatch's recompute ahead of its gradient, as the engine runs it.

Cheap where it can be without changing a result: the task graph depends on the slot count, not
the slot times, so candidates of one count share it; a windowed run stops once the window's last
compute has started; a makespan can be given up once it is sure to pass a bound. Plain floats
only: it must never build plans or import torch or the scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Sequence

from roundpipe.plan import native

# Between two computes the engine runs transfer and optimizer tasks, which take no time here but
# still come after the compute that freed a device: a device freed at time T starts what was ready
# before the transfers that T's completions set off. Each dependency counts its tasks in between.
_ACTIVATION_HOPS = 2  # act_down, act_up
_PARAM_HOPS = 1  # param_up (one stage of prefetch)
_WEIGHT_HOPS = 5  # grad_down, G-copy, step, P-copy, param_up
_UPLOAD_HOPS = 3  # param_up, P-copy, param_up: an upload of the weights before, then this one's
_GATE_HOPS = 1  # param_up: a training loop submits the next iteration once the losses are in


class Shape:
    """The task graph of `_structure`: per task its slot, device, unmet deps and dependents, where
    each run's tasks begin, and per device its tasks ready at the start. Read only: a run copies
    ``unmet`` and ``ready``.

    A dependent is one int, ``hops * count + task`` (count: the number of tasks): no tuple to
    unpack in the list schedule's loop, and the key by which `_list_schedule` orders dependencies
    met after transfers.

    A graph with weight waits or a gate is its ``base`` (the bare graph of its slot count) plus
    ``extra`` dependents: two lists, sources and codes, in the order they were added, each
    source's after its base dependents. Its ``after`` and ``ready`` lists are built only when
    read (the Python loop); the compiled loop reads the base's packed arrays and the extras."""

    __slots__ = (
        "_after",
        "_packed",
        "_ready",
        "_run_starts",
        "base",
        "count",
        "device",
        "extra",
        "num_devices",
        "run_start",
        "slot",
        "unmet",
    )

    def __init__(
        self,
        slot: list[int],
        device: list[int],
        unmet: Sequence[int],
        after: list[list[int]] | None,
        run_start: list[int],
        num_devices: int,
        *,
        base: Shape | None = None,
        extra: tuple[Sequence[int], Sequence[int]] = ([], []),
    ) -> None:
        self.slot, self.device, self.unmet, self.run_start = slot, device, unmet, run_start
        self.count, self.num_devices = len(slot), num_devices
        self.base, self.extra = base, extra
        self._after = after
        self._ready: list[list[int]] | None = None
        self._packed: tuple[array, ...] | None = None
        self._run_starts: array | None = None

    @property
    def after(self) -> list[list[int]]:
        if self._after is None and self.base is None:  # a base `native` built: from its arrays
            assert self._packed is not None
            offsets, flat = self._packed[2], self._packed[3]
            self._after = [flat[a:b].tolist() for a, b in itertools.pairwise(offsets)]
        if self._after is None:
            assert self.base is not None
            after = list(self.base.after)
            extra: dict[int, list[int]] = {}
            for source, code in zip(*self.extra, strict=True):
                extra.setdefault(source, []).append(code)
            for source, codes in extra.items():
                after[source] = after[source] + codes
            self._after = after
        return self._after

    @property
    def ready(self) -> list[list[int]]:
        if self._ready is None:
            ready: list[list[int]] = [[] for _ in range(self.num_devices)]
            device = self.device
            for t, waiting in enumerate(self.unmet):
                if not waiting:
                    ready[device[t]].append(t)  # ascending: already a heap
            self._ready = ready
        return self._ready

    def packed(self) -> tuple[array, ...]:
        """The graph as arrays for `native`'s loop: slot, device, dependents (offsets, flat), unmet
        and the extra dependents (sources, codes). Packed once, on first use; a base's arrays are
        shared by the graphs built on it."""
        if self._packed is None:
            if self.base is not None:
                slot, device, offsets, flat = self.base.packed()[:4]
            else:
                slot, device = native.ints(self.slot), native.ints(self.device)
                offsets, flat = native.csr(self.after)
            sources, codes = self.extra
            self._packed = (slot, device, offsets, flat, *map(_as_ints, (self.unmet, sources, codes)))
        return self._packed

    def run_starts(self) -> array:
        """``run_start`` packed (`native`'s extras of `_structure`), once."""
        if self._run_starts is None:
            self._run_starts = native.ints(self.run_start)
        return self._run_starts


def _as_ints(values: Sequence[int]) -> array:
    return values if isinstance(values, array) else native.ints(values)


def _structure(
    s_count: int,
    num_devices: int,
    rounds: tuple[int, ...],
    iterations: int,
    weight_waits: tuple[tuple[int, ...], ...] | None,
    base: Shape | None = None,
    sharers: tuple[tuple[int, ...], ...] | None = None,
    gate: int | None = None,
    gate_lag: int = 0,
) -> Shape:
    """Every microbatch task in dispatch order (see `Shape`). Only the slot count shapes it, not
    the slot times, so candidates of one slot count share it (`stream_ms`'s ``shapes``). The async
    weight waits differ between plans of one count, so they go on ``base`` (the same graph without
    them, built here if not given) as extra dependents; so does ``gate`` (the fused slot:
    iteration t's runs start only once iteration t - 1 - ``gate_lag``'s fused runs, which compute
    the losses, are done, as a training loop submits them)."""
    if base is None:
        base = _runs_structure(s_count, num_devices, rounds, iterations)
    if weight_waits is None and gate is None:
        return base
    run_start, count = base.run_start, base.count
    kernels = native.kernels()
    if kernels is not None:  # the same loops, compiled (`native`)
        waits_offsets, waits_flat = native.csr(weight_waits or ())
        shares_offsets, shares_flat = native.csr(sharers or ())
        unmet_array, sources_array, codes_array = kernels.stream_extras(
            *(
                base.run_starts(),
                base.packed()[4],
                s_count,
                len(rounds),
                -1 if gate is None else gate,
                gate_lag,
            ),
            *(waits_offsets, waits_flat, shares_offsets, shares_flat),
            *(weight_waits is not None, sharers is not None, num_devices),
            *(_GATE_HOPS * count, _WEIGHT_HOPS * count, _UPLOAD_HOPS * count),
        )
        return Shape(
            *(base.slot, base.device, unmet_array, None, run_start, num_devices),
            base=base,
            extra=(sources_array, codes_array),
        )
    unmet = list(base.unmet)
    sources: list[int] = []
    codes: list[int] = []
    per = s_count * len(rounds)
    if gate is not None:
        code = _GATE_HOPS * count
        for t in range(1 + gate_lag, (len(run_start) - 1) // per):
            losses = [
                run_start[(t - 1 - gate_lag) * per + r * s_count + gate + 1] - 1 for r in range(len(rounds))
            ]
            for run in range(t * per, (t + 1) * per):
                first = run_start[run]
                for source in losses:
                    sources.append(source)
                    codes.append(code + first)
                    unmet[first] += 1
    if weight_waits is not None:
        for run in range(2 * per, len(run_start) - 1):  # iteration t reads the weights of step t-2
            first = run_start[run]
            earlier = (run // per - 2) * per
            code = _WEIGHT_HOPS * count + first
            for waited in weight_waits[run % s_count]:
                for r in range(len(rounds)):
                    sources.append(run_start[earlier + r * s_count + waited + 1] - 1)
                    codes.append(code)
                    unmet[first] += 1
    if weight_waits is not None and sharers is not None:
        # An iteration's weights are copied in (P-copy) only once every upload of the weights
        # before them is done: iteration t's run of slot i waits for the uploads of iteration
        # t - 1's runs of the slots sharing a layer with it (iteration 2 also iteration 0's: both
        # read the first weights), each after the device's run 2N before it (none: at the start).
        n2 = 2 * num_devices
        for run in range(2 * per, len(run_start) - 1):
            t, first = run // per, run_start[run]
            code = _UPLOAD_HOPS * count + first
            for at in range(0 if t == 2 else (t - 1) * per, t * per, per):
                for sharer in sharers[run % s_count]:
                    for r in range(len(rounds)):
                        q = at + r * s_count + sharer - n2
                        if q >= 0:
                            sources.append(run_start[q + 1] - 1)
                            codes.append(code)
                            unmet[first] += 1
    return Shape(
        base.slot, base.device, unmet, None, run_start, num_devices, base=base, extra=(sources, codes)
    )


def _runs_structure(s_count: int, num_devices: int, rounds: tuple[int, ...], iterations: int) -> Shape:
    """`_structure` without weight waits, built run by run: a run's tasks are consecutive and the
    next run of its round (the next slot) follows right after, so a task's dependents are the run's
    next task and the same microbatch at the next slot, ``size`` tasks on."""
    n = num_devices
    kernels = native.kernels()
    if kernels is not None:  # the same graph, built compiled (`native`) and kept packed
        hops = (_ACTIVATION_HOPS, _PARAM_HOPS)
        packed = kernels.stream_base(s_count, n, native.ints(rounds), iterations, *hops)
        slots, devices, waits, offsets, flat, starts = packed
        shape = Shape(slots.tolist(), devices.tolist(), waits.tolist(), None, starts.tolist(), n)
        shape._packed = (slots, devices, offsets, flat, waits, native.ints(()), native.ints(()))
        shape._run_starts = starts
        return shape
    slot: list[int] = []
    device: list[int] = []
    run_start: list[int] = []
    sizes: list[int] = []
    k = 0
    for _ in range(iterations):
        for size in rounds:
            for i in range(s_count):
                run_start.append(len(slot))
                sizes.append(size)
                slot.extend([i] * size)
                device.extend([k % n] * size)
                k += 1
    run_start.append(len(slot))
    count = len(slot)
    activation, param = _ACTIVATION_HOPS * count, _PARAM_HOPS * count
    unmet: list[int] = []
    after: list[list[int]] = []
    for run in range(k):
        first, size = run_start[run], sizes[run]
        stop = first + size
        i = run % s_count
        if i < s_count - 1:  # the same microbatch at the next slot of the round
            after += [[t + 1, activation + t + size] for t in range(first, stop - 1)]
            last = [activation + stop - 1 + size]
        else:
            after += [[t + 1] for t in range(first, stop - 1)]
            last = []
        if run + 2 * n < k:  # one stage of prefetch: the device's run after next waits for this one
            last.append(param + run_start[run + 2 * n])
        after.append(last)
        # a task waits for the run's previous microbatch and the same one at the previous slot;
        # the first, instead of the former, for the device's run before last
        unmet.append((i > 0) + (run >= 2 * n))
        unmet += [1 + (i > 0)] * (size - 1)
    return Shape(slot, device, unmet, after, run_start, n)


def stream_ms(
    slot_ms: Sequence[float],
    num_devices: int,
    rounds: Sequence[int],
    *,
    iterations: int = 1,
    window: tuple[int, int] | None = None,
    weight_waits: Sequence[Sequence[int]] | None = None,
    sharers: Sequence[Sequence[int]] | None = None,
    give_up: float = math.inf,
    shapes: dict[object, Shape] | None = None,
    gate: int | None = None,
    gate_lag: int = 0,
) -> float:
    """Modelled ms per iteration: the makespan of ``iterations`` chained iterations (fill and drain
    included), or with ``window=(a, b)`` the time from iteration a's first compute to iteration b's,
    over b - a (the steady time of an async run; needs ``iterations > b``). ``gate`` (the fused
    slot's index): iterations submitted as a training loop submits them, each once the previous
    one's fused runs (its losses) are done, instead of chained; with ``gate_lag`` 1, once those of
    the one before it are (a loop that reads each loss one iteration late).

    ``weight_waits[i]`` (async runs): the slots whose gradients slot i's weights wait for, two
    iterations back (the backward and fused slots that hold slot i's layers). ``sharers[i]`` (async
    runs, with ``weight_waits``): the slots sharing a layer with slot i (`sharers`), whose uploads
    of the iteration before slot i's weights wait for (the P-copy overwrites what they read).

    ``give_up``: once the answer is sure to exceed it, inf instead (a ranking that keeps the best
    few needs no more about a plan that cannot be one of them): for a window, once iteration b's
    first compute has not started ``(b - a) * give_up`` after iteration a's. ``shapes``: the task
    graphs of earlier calls by slot count, for calls that rank many plans."""
    waits = None if weight_waits is None else _frozen(weight_waits)
    shares = None if sharers is None or waits is None else _frozen(sharers)
    s_count = len(slot_ms)
    key = (s_count, num_devices, tuple(rounds), iterations, waits, shares, gate, gate_lag)
    shape = shapes.get(key) if shapes is not None else None
    if shape is None:
        base = None
        if shapes is not None and (waits is not None or gate is not None):  # the bare graph, shared
            bare = (s_count, num_devices, tuple(rounds), iterations, None, None, None, 0)
            base = shapes.get(bare)
            if base is None:
                base = shapes[bare] = _runs_structure(*bare[:4])
        shape = _structure(*key[:5], base=base, sharers=shares, gate=gate, gate_lag=gate_lag)
        if shapes is not None:
            shapes[key] = shape
    if window is None:
        left = _tails(slot_ms, shape, num_devices) if give_up < math.inf else None
        # float sums: the bound must never pass the makespan by rounding, hence the margin
        margin = give_up * (1 + 1e-9)
        now, _ = _list_schedule(slot_ms, shape, give_up=margin, left=left, every_start=False)
        return now
    per = len(rounds) * s_count
    a, b = window
    watched = (shape.run_start[a * per], shape.run_start[b * per])
    span = give_up * (1 + 1e-9) * (b - a)  # the margin as above
    now, (first, last) = _list_schedule(slot_ms, shape, watched=watched, span=span, every_start=False)
    if now == math.inf:
        return now
    return (last - first) / (b - a)


def _frozen(rows: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``rows`` as a tuple of tuples (a key of `stream_ms`'s graphs); as given if it is one."""
    if type(rows) is tuple and all(type(row) is tuple for row in rows):
        return rows
    return tuple(tuple(row) for row in rows)


def _tails(slot_ms: Sequence[float], shape: Shape, num_devices: int) -> list[float]:
    """Per device, a lower bound of the makespan beyond the start of its work: all of that work,
    then the fewest slots after any of its tasks (whichever ends last still goes through them)."""
    after_slot = [0.0] * len(slot_ms)
    for i in range(len(slot_ms) - 2, -1, -1):
        after_slot[i] = after_slot[i + 1] + slot_ms[i + 1]
    tail = [math.inf] * num_devices
    work = [0.0] * num_devices
    slot, device = shape.slot, shape.device
    for first, stop in itertools.pairwise(shape.run_start):  # run by run: one slot, one device each
        d, i = device[first], slot[first]
        tail[d] = min(tail[d], after_slot[i])
        work[d] += slot_ms[i] * (stop - first)
    return [w + x if x < math.inf else 0.0 for w, x in zip(work, tail, strict=True)]


def _list_schedule(
    slot_ms: Sequence[float],
    shape: Shape,
    *,
    give_up: float = math.inf,
    left: list[float] | None = None,
    watched: tuple[int, ...] = (),
    span: float = math.inf,
    every_start: bool = True,
) -> tuple[float, list[float]]:
    """Run the tasks of `_structure`: a free device starts its ready task first in dispatch order.
    Returns when the last ends and when each started (``every_start=False``: the ``watched``
    tasks only, in their order, and the compiled loop makes no float of the others: a quarter
    of a windowed call); early (inf) as `event_loop` says."""
    kernels = native.kernels()
    if kernels is not None:  # the same loop, compiled (`native`)
        n = shape.num_devices
        return kernels.list_schedule(  # type: ignore[no-any-return]
            *(native.floats(slot_ms), *shape.packed(), n),
            *(native.floats(left or [0.0] * n), give_up, native.ints(watched), span, every_start),
        )
    ready = [list(r) for r in shape.ready]
    duration = [slot_ms[i] for i in shape.slot]
    run = event_loop(
        duration, shape.device, shape.after, list(shape.unmet), ready, left, give_up, watched, span
    )
    now, start = run
    return now, start if every_start else [start[t] for t in watched]


class SplitExtras:
    """`_split_stream.split_ms`'s dependents that come from the plan rather than the graph: when
    task t ends, ``uploads[uploads_after[t]]`` (the uploads of the device's run after next, for a
    run's last task), and for a forward run q's microbatch j (``saving[t] = q * bound + j``) every
    code of ``readers[q]``, 2j on (the recomputes reading its saved activation). -1: none."""

    __slots__ = ("bound", "readers", "saving", "uploads", "uploads_after")

    def __init__(
        self,
        uploads_after: list[int],
        uploads: list[int],
        saving: list[int],
        readers: list[list[int]],
        bound: int,
    ) -> None:
        self.uploads_after, self.uploads, self.saving = uploads_after, uploads, saving
        self.readers, self.bound = readers, bound


def event_loop(
    duration: Sequence[float],
    device: Sequence[int],
    after: Sequence[Sequence[int]],
    unmet: list[int],
    ready: list[list[int]],
    left: list[float] | None = None,
    give_up: float = math.inf,
    watched: tuple[int, ...] = (),
    span: float = math.inf,
    split: SplitExtras | None = None,
) -> tuple[float, list[float]]:
    """The list schedule of both stream models (`_list_schedule`, `_split_stream.split_ms`; the
    reference of `_kernels.c`'s ``stream_loop``), on a graph's ``unmet`` and per device ``ready``
    heaps (both used up): a free device starts its ready task first in task order; computes end
    in time order; a dependent numbered past the task count (``hops * count + task``) is met once
    every compute ending at that instant has, by that number. Returns when the last task ends and
    every start (-1: not started); early (inf) once device d, starting a task at ``now`` with
    ``left[d]`` to do, shows the makespan past ``give_up``, or once ``watched`` all started (early,
    inf, once a compute ends ``span`` after the first of them started while another has not: it
    can start no earlier than that). ``split``: the split model's dependents from the plan."""
    k = len(duration)
    num_devices = len(ready)
    left = list(left or [0.0] * num_devices)
    watch, waiting = _flags(k, watched), len(set(watched)) or -1
    opening, deadline = (watched[0] if watched else -1), math.inf
    busy, start = [False] * num_devices, [-1.0] * k
    ends: list[tuple[float, int]] = []  # computes that end: (time, task)
    met: list[int] = []  # dependencies met after the transfers in between, by (hops, task)
    heappush, heappop = heapq.heappush, heapq.heappop
    now, touched = 0.0, list(range(num_devices))
    while True:
        for d in touched:
            if not busy[d] and ready[d]:
                t = heappop(ready[d])
                busy[d] = True
                start[t] = now
                heappush(ends, (now + duration[t], t))
                if now + left[d] > give_up:
                    return math.inf, start
                left[d] -= duration[t]
                if watch[t]:
                    waiting -= 1
                    if not waiting:
                        return now, start
                    if t == opening:
                        deadline = now + span
        touched = []
        if ends and (ends[0][0] == now or not met):
            now, t = heappop(ends)
            if now > deadline:
                return math.inf, start
        elif met:
            t = heappop(met) % k
            unmet[t] -= 1
            if not unmet[t]:
                heappush(ready[device[t]], t)
                touched.append(device[t])
            continue
        else:
            break
        busy[device[t]] = False
        touched.append(device[t])
        for u in after[t]:
            if u >= k:  # met after transfers
                heappush(met, u)
            else:
                unmet[u] -= 1
                if not unmet[u]:
                    heappush(ready[device[u]], u)
                    touched.append(device[u])
        if split is not None:
            if split.uploads_after[t] >= 0:
                heappush(met, split.uploads[split.uploads_after[t]])
            if split.saving[t] >= 0:
                q, j = divmod(split.saving[t], split.bound)
                for code in split.readers[q]:
                    heappush(met, code + 2 * j)
    return now, start


def _flags(count: int, tasks: tuple[int, ...]) -> bytearray:
    flags = bytearray(count)
    for t in tasks:
        flags[t] = 1
    return flags


def weight_waits(
    fwd: Sequence[range], fused: range, bwd: Sequence[range], shares: list[list[int]] | None = None
) -> list[list[int]]:
    """For each slot (dispatch order ``fwd, fused, bwd``), the fused and backward slots that hold
    one of its layers: an async iteration's upload of a layer waits for the step of two iterations
    back, which waits for that layer's gradients. ``shares``: `sharers` of the same stages, if at
    hand (these are its slots from the fused one on)."""
    if shares is None:
        shares = sharers(fwd, fused, bwd)
    return [[slot for slot in row if slot >= len(fwd)] for row in shares]


def sharers(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> list[list[int]]:
    """For each slot (dispatch order ``fwd, fused, bwd``), the slots that hold one of its layers,
    itself included: the runs whose uploads of those layers an async iteration's P-copy waits for.

    The ranking asks this of every candidate it models. The forward chain and the backward one
    (read shallowest first) each run over adjacent layer ranges from layer 0, the fused stage
    holds the rest: then one walk along both chains at once finds every overlapping pair (no
    more than the two chains' stages), where comparing every pair cost 5% of an async choice at
    94 layers. Stages of any other form are compared pair by pair."""
    f_count, b_count = len(fwd), len(bwd)
    if not _chains_meet(fwd, fused, bwd):
        stages = (*fwd, fused, *bwd)
        return [
            [j for j, held in enumerate(stages) if held.start < r.stop and r.start < held.stop]
            for r in stages
        ]
    rows: list[list[int]] = [[] for _ in range(f_count + 1 + b_count)]
    rows[f_count].append(f_count)
    i = k = 0  # fwd[i] and the backward stage k from the shallowest, slot f_count + b_count - k
    while i < f_count and k < b_count:
        b_slot = f_count + b_count - k
        rows[i].append(b_slot)
        rows[b_slot].append(i)
        f_stop, b_stop = fwd[i].stop, bwd[b_count - 1 - k].stop
        i += f_stop <= b_stop
        k += b_stop <= f_stop
    for i in range(f_count):
        rows[i].insert(0, i)  # the forward slot itself, first; then its backward slots, deepest last
        rows[i][1:] = rows[i][:0:-1]
    for b_slot in range(f_count + 1, f_count + 1 + b_count):
        rows[b_slot].append(b_slot)
    return rows


Rows = tuple[tuple[int, ...], ...]


def sharers_and_waits(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> tuple[Rows, Rows]:
    """`sharers` and `weight_waits` of the same stages, as tuples (what `stream_ms` keys its task
    graphs by). The async ranking asks them of every candidate it models (a quarter of its time at
    94 layers in Python): compiled where `native` was built, which compares every pair of stages
    (the walk above finds the same pairs, in the same order)."""
    kernels = native.kernels()
    if kernels is not None:
        return kernels.sharers((*fwd, fused, *bwd), len(fwd))  # type: ignore[no-any-return]
    shares = sharers(fwd, fused, bwd)
    waits = weight_waits(fwd, fused, bwd, shares)
    return tuple(map(tuple, shares)), tuple(map(tuple, waits))


def _chains_meet(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> bool:
    """Whether the forward chain and the backward one (deepest first) each cover [0, fused.start)
    with adjacent non-empty ranges, and the fused stage is non-empty: `sharers`' walk."""
    if not fwd or not bwd or not len(fused):
        return False
    if fwd[0].start != 0 or bwd[-1].start != 0 or fwd[-1].stop != fused.start or bwd[0].stop != fused.start:
        return False
    if not all(len(r) for r in fwd) or not all(len(r) for r in bwd):
        return False
    return all(r.stop == nxt.start for r, nxt in itertools.pairwise(fwd)) and all(
        nxt.stop == r.start for r, nxt in itertools.pairwise(bwd)
    )
