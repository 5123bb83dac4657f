"""The task graph of the stream model (`_stream.stream_ms`): every microbatch task of a plan's
runs in dispatch order, its device, its unmet dependencies and its dependents.

Why a module of its own: only the slot count (and, async, which slots wait for which) shapes the
graph, never the slot times, so it is built once per shape and shared by every candidate of that
count; building it has rules of its own (prefetch, weight waits, a training loop's gate), which
the list schedule that runs it must not need to know. It builds graphs only: it must never time
them, build plans, or import torch or the scheduler.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from types import ModuleType

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
    kernels = native.kernels()
    if kernels is not None:  # the same loops, compiled (`native`)
        return _compiled_extras(
            kernels, s_count, num_devices, rounds, weight_waits, base, sharers, gate, gate_lag
        )
    run_start, count = base.run_start, base.count
    unmet = list(base.unmet)
    sources: list[int] = []
    codes: list[int] = []
    per = s_count * len(rounds)
    if gate is not None:
        for t in range(1 + gate_lag, (len(run_start) - 1) // per):
            losses = [
                run_start[(t - 1 - gate_lag) * per + r * s_count + gate + 1] - 1 for r in range(len(rounds))
            ]
            for run in range(t * per, (t + 1) * per):
                first = run_start[run]
                for source in losses:
                    sources.append(source)
                    codes.append(_GATE_HOPS * count + first)
                    unmet[first] += 1
    if weight_waits is not None:
        for run in range(2 * per, len(run_start) - 1):  # iteration t reads the weights of step t-2
            first = run_start[run]
            earlier = (run // per - 2) * per
            for waited in weight_waits[run % s_count]:
                for r in range(len(rounds)):
                    sources.append(run_start[earlier + r * s_count + waited + 1] - 1)
                    codes.append(_WEIGHT_HOPS * count + first)
                    unmet[first] += 1
    if weight_waits is not None and sharers is not None:
        _upload_waits(base, s_count, len(rounds), sharers, num_devices, (unmet, sources, codes))
    return Shape(
        base.slot, base.device, unmet, None, run_start, num_devices, base=base, extra=(sources, codes)
    )


def _compiled_extras(
    kernels: ModuleType,
    s_count: int,
    num_devices: int,
    rounds: tuple[int, ...],
    weight_waits: tuple[tuple[int, ...], ...] | None,
    base: Shape,
    sharers: tuple[tuple[int, ...], ...] | None,
    gate: int | None,
    gate_lag: int,
) -> Shape:
    """`_structure`'s graph with extra dependents, built by `native`'s compiled loops."""
    count = base.count
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
        *(base.slot, base.device, unmet_array, None, base.run_start, num_devices),
        base=base,
        extra=(sources_array, codes_array),
    )


def _upload_waits(
    base: Shape,
    s_count: int,
    round_count: int,
    sharers: tuple[tuple[int, ...], ...],
    num_devices: int,
    into: tuple[list[int], list[int], list[int]],
) -> None:
    """Add to ``into`` (unmet, sources, codes) what an iteration's P-copy waits for: it copies the
    weights in only once every upload of the weights before them is done, so iteration t's run of
    slot i waits for the uploads of iteration t - 1's runs of the slots sharing a layer with it
    (iteration 2 also iteration 0's: both read the first weights), each after the device's run 2N
    before it (none: at the start)."""
    unmet, sources, codes = into
    run_start, per, n2 = base.run_start, s_count * round_count, 2 * num_devices
    for run in range(2 * per, len(run_start) - 1):
        t, first = run // per, run_start[run]
        code = _UPLOAD_HOPS * base.count + first
        for at in range(0 if t == 2 else (t - 1) * per, t * per, per):
            for sharer in sharers[run % s_count]:
                for r in range(round_count):
                    q = at + r * s_count + sharer - n2
                    if q >= 0:
                        sources.append(run_start[q + 1] - 1)
                        codes.append(code)
                        unmet[first] += 1


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
