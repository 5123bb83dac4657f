"""`split_ms`: the round-robin stream model of `_stream` with a backward microbatch in two tasks.

Sync plans are ranked by `split_ms`, the same list schedule with a backward microbatch in two
tasks, its recompute ahead of its gradient as the engine runs it (and the saved activation and
one parameter upload per layer that the recompute waits for): on the profile grid's even plans
`stream_ms` is up to 16% slower than the engine (and 36% faster on a few), `split_ms` gives the
engine's time on most of them and stays within 2% (on one device and on plans of no more slots
than devices, the engine's time: `tests/test_schedule_models.py`). It costs about 1.7 times
`stream_ms` per plan; async ranking uses `stream_ms`.

A backward run's recompute waits for its saved activation and one parameter upload per layer,
never for the gradient; its backward waits for the gradient and its own recompute. It shares the
list schedule of `_stream.stream_ms` (one loop, `_event_loop.event_loop`) and its bounds' reasoning;
it must never build plans or import torch or the scheduler.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

from roundpipe.plan import native
from roundpipe.plan._event_loop import SplitExtras, event_loop
from roundpipe.plan._stream_graph import _ACTIVATION_HOPS


class Split:
    """What `split_ms` needs of a plan besides its slot times. ``first_backward``: the first
    backward slot (the one after the fused slot); per slot, ``recompute_ms`` (a backward stage's
    forward, 0 elsewhere), ``saved`` (the forward slot whose saved activation a backward slot
    recomputes from; -1 elsewhere and for the stage that starts at layer 0, which reads the
    batch) and ``layers`` (its layer count: a run's parameters go up one layer at a time)."""

    __slots__ = ("first_backward", "layers", "recompute_ms", "saved")

    def __init__(
        self, first_backward: int, recompute_ms: Sequence[float], saved: Sequence[int], layers: Sequence[int]
    ) -> None:
        self.first_backward = first_backward
        self.recompute_ms, self.saved, self.layers = recompute_ms, saved, layers

    def heads(self, slot_ms: Sequence[float]) -> list[float]:
        """Per slot, the least time before its first task can start: after the slots before it
        (forward and fused slots), or after the forward slot it recomputes from (backward slots:
        the recompute need not wait for the gradient)."""
        pre = [0.0]
        for ms in slot_ms[: self.first_backward]:
            pre.append(pre[-1] + ms)
        return pre[: self.first_backward] + [
            pre[f + 1] if f >= 0 else 0.0 for f in self.saved[self.first_backward :]
        ]

    def tails(self, slot_ms: Sequence[float]) -> list[float]:
        """Per slot, the least time after any of its tasks ends until the makespan: its
        microbatch still goes through the later slots, less their recomputes (which may have run
        ahead). Never rises along the slots."""
        after = [0.0] * len(slot_ms)
        for i in range(len(slot_ms) - 2, -1, -1):
            after[i] = after[i + 1] + (slot_ms[i + 1] - self.recompute_ms[i + 1])
        return after


def split_ms(
    slot_ms: Sequence[float],
    split: Split,
    num_devices: int,
    rounds: Sequence[int],
    *,
    give_up: float = math.inf,
    graphs: dict[object, SplitGraph] | None = None,
) -> float:
    """The sync makespan (one iteration) with each backward microbatch in two tasks, as the engine
    runs it: the recompute, after the run's previous microbatch, the saved activation (the forward
    slot's compute, then its download and upload) and the run's parameters (one upload per layer
    after the device's run before last); then the rest, after the recompute and the gradient from
    the slot before. The engine keeps a device busy with recomputes while gradients are on their
    way; the whole-microbatch model (`stream_ms`) cannot, and is up to 16% slow on plans whose
    first backward runs wait for gradients (the profile grid's even plans; this model gives the
    engine's time on most of them and is within 2% on all).

    ``give_up`` as in `stream_ms`; ``graphs``: the `SplitGraph`s of earlier calls, by slot count."""
    s_count, first_backward, n = len(slot_ms), split.first_backward, num_devices
    # the graph gives every backward slot but the last (the one starting at layer 0) a saved input
    assert split.saved[-1] < 0 and min(split.saved[first_backward:-1], default=0) >= 0
    key = (s_count, n, tuple(rounds))
    graph = graphs.get(key) if graphs is not None else None
    if graph is None:
        graph = SplitGraph(s_count, n, tuple(rounds))
        if graphs is not None:
            graphs[key] = graph
    count, pos, sizes, layers = graph.count, graph.pos, graph.sizes, split.layers
    runs = len(sizes)
    duration = graph.durations(slot_ms, split.recompute_ms, first_backward)
    # the uploads of run q + 2N (one hop per layer) and the recomputes reading forward run q
    uploads = []
    for q in range(2 * n, runs):
        i = q % s_count
        uploads.append(layers[i] * count + 2 * pos[q] + (i < first_backward))
    readers: list[list[int]] = [[] for _ in range(runs)]
    hops = _ACTIVATION_HOPS * count
    for at in range(0, runs, s_count):
        for i in range(first_backward, s_count - 1):
            readers[at + split.saved[i]].append(hops + 2 * pos[at + i])
    left = _split_tails(slot_ms, split, graph, n) if give_up < math.inf else None
    margin = give_up * (1 + 1e-9)  # as in `stream_ms`
    kernels = native.kernels()
    if kernels is not None:  # the same loop, compiled (`native`)
        return kernels.split_schedule(  # type: ignore[no-any-return]
            native.floats(duration),
            *graph.packed_layout(first_backward),
            *(native.ints(uploads), graph.arrays()[2], *native.csr(readers)),
            *(n, graph.bound, native.floats(left or [0.0] * n), margin),
        )
    after, unmet, saving, ready = graph.layout(first_backward)  # read only: the loop uses copies
    extras = SplitExtras(graph.uploads_after, uploads, saving, readers, graph.bound)
    ready_now = [list(tasks) for tasks in ready]
    return event_loop(duration, graph.device, after, list(unmet), ready_now, left, margin, split=extras)[0]


class SplitGraph:
    """`split_ms`'s task graph for one slot count: two task numbers per microbatch of each run in
    dispatch order (2p: a backward run's recompute; 2p + 1: the microbatch's last task, a forward
    or fused run's only one, whose 2p never runs), so that every plan of the count, wherever its
    backward slots begin, numbers its tasks alike. A run's dependents and waits depend on its kind
    (forward or backward): each is built once, when a plan first asks for it (`run`); plans of one
    count differ in the kind of a few runs only.

    A microbatch's last task waits for its last task at the slot before (activation or gradient);
    a run's microbatch for the run's previous one; a run's first task for the device's run before
    last (uploads, `split_ms`); a recompute for its saved activation (every backward slot but the
    last, which starts at layer 0; `split_ms` adds which forward run) and on a single device for
    the device's previous run (`GraphBuilder._backward_context`)."""

    __slots__ = (
        "_arrays",
        "_layouts",
        "_packed",
        "_runs",
        "bound",
        "count",
        "device",
        "num_devices",
        "pos",
        "s_count",
        "sizes",
        "uploads_after",
    )

    def __init__(self, s_count: int, num_devices: int, rounds: tuple[int, ...]) -> None:
        n = num_devices
        self.s_count, self.num_devices = s_count, n
        self.sizes = [size for size in rounds for _ in range(s_count)]
        self.pos = [0]
        self.device: list[int] = []
        for k, size in enumerate(self.sizes):
            self.pos.append(self.pos[-1] + size)
            self.device += [k % n] * (2 * size)
        self.count = 2 * self.pos[-1]
        self.bound = max(rounds)  # `split_ms`'s ``saving``: run * bound + microbatch
        # per task, the run whose uploads wait for it (its last task), -1: none
        self.uploads_after = [-1] * self.count
        for q in range(len(self.sizes) - 2 * n):
            self.uploads_after[2 * self.pos[q + 1] - 1] = q
        self._runs: dict[tuple[int, bool, bool], tuple[list[list[int]], list[int]]] = {}
        self._layouts: dict[int, tuple[list[list[int]], list[int], list[int], list[list[int]]]] = {}
        self._packed: dict[int, tuple[array, ...]] = {}  # `packed_layout`, by first backward slot
        self._arrays: tuple[array, array, array] | None = None  # device, sizes, uploads_after

    def arrays(self) -> tuple[array, array, array]:
        """``device``, ``sizes`` and ``uploads_after`` as arrays for `native`, packed once."""
        if self._arrays is None:
            self._arrays = (
                native.ints(self.device),
                native.ints(self.sizes),
                native.ints(self.uploads_after),
            )
        return self._arrays

    def packed_layout(self, first_backward: int) -> tuple[array, ...]:
        """`layout` as arrays for `native`'s loop: device, dependents (offsets, flat), unmet and
        ``saving`` (the compiled loop starts from the tasks with nothing unmet: `layout`'s ready)."""
        if first_backward not in self._packed:
            device, sizes, _ = self.arrays()
            kernels = native.kernels()
            assert kernels is not None, "packed_layout() is for the compiled loop"
            hops = _ACTIVATION_HOPS * self.count
            layout = kernels.split_layout(
                sizes, self.s_count, self.num_devices, first_backward, self.bound, hops
            )
            offsets, flat, unmet, _, saving = layout  # the tasks ready at the start: those unmet 0
            self._packed[first_backward] = (device, offsets, flat, unmet, saving)
        return self._packed[first_backward]

    def layout(self, first_backward: int) -> tuple[list[list[int]], list[int], list[int], list[list[int]]]:
        """For plans whose backward slots begin at ``first_backward``: every task's dependents
        and unmet waits (`run`, run after run), per task the code `split_ms` gives a forward
        run's microbatch whose saved activation recomputes read (-1: none), and per device the
        tasks ready at the start. Built once per first backward slot; read only."""
        if first_backward in self._layouts:
            return self._layouts[first_backward]
        s_count, n = self.s_count, self.num_devices
        after: list[list[int]] = []
        unmet: list[int] = []
        saving = [-1] * self.count
        ready: list[list[int]] = [[] for _ in range(n)]
        for run, size in enumerate(self.sizes):
            i = run % s_count
            backward = i >= first_backward
            run_after, run_unmet = self.run(run, backward, n == 1 and first_backward <= i + 1 < s_count)
            first = len(unmet)  # 2 * pos[run]
            after += run_after
            unmet += run_unmet
            if not backward:
                if i < first_backward - 1:  # a forward run: the plan says which recomputes read it
                    saving[first + 1 : first + 2 * size : 2] = range(
                        run * self.bound, run * self.bound + size
                    )
                first += 1
            if not unmet[first]:
                ready[run % n].append(first)
        self._layouts[first_backward] = after, unmet, saving, ready
        return after, unmet, saving, ready

    def durations(
        self, slot_ms: Sequence[float], recompute_ms: Sequence[float], first_backward: int
    ) -> list[float]:
        """Every task's duration: a backward microbatch's recompute and the rest, a forward or
        fused microbatch 0 and its time (its task 2p never runs), run after run."""
        per_slot = [
            (recompute_ms[i], ms - recompute_ms[i]) if i >= first_backward else (0.0, ms)
            for i, ms in enumerate(slot_ms)
        ]
        duration: list[float] = []
        s_count = self.s_count
        for start in range(0, len(self.sizes), s_count):  # a round: every slot with its size
            size = self.sizes[start]
            for pair in per_slot:
                duration += pair * size
        return duration

    def run(self, run: int, backward: bool, before_backward: bool) -> tuple[list[list[int]], list[int]]:
        """The dependents and unmet waits of the run's tasks (read only), as a forward or a
        backward run; ``before_backward`` (one device only): the next run is a backward run, whose
        first recompute also waits for this run's last task."""
        key = (run, backward, before_backward)
        if key in self._runs:
            return self._runs[key]
        s_count, n, size = self.s_count, self.num_devices, self.sizes[run]
        i, first, stop = run % s_count, 2 * self.pos[run], 2 * self.pos[run + 1]
        uploads = int(run >= 2 * n)
        # microbatch j's last task (first + 2j + 1): to the next slot's last task of j, to + 2j
        to = _ACTIVATION_HOPS * self.count + stop + 1
        lasts = [[to + 2 * j] for j in range(size)] if i < s_count - 1 else [[] for _ in range(size)]
        for j in range(size - 1):
            lasts[j].append(first + 2 * j + 2 + (not backward))  # the run's next microbatch
        if before_backward:
            lasts[-1].append(stop)
        after: list[list[int]] = [[]] * (2 * size)
        after[1::2] = lasts
        unmet = [0] * (2 * size)
        if backward:  # a recompute, then the rest (after it and the gradient: i > 0)
            after[0::2] = [[t + 1] for t in range(first, stop, 2)]
            saved = int(i < s_count - 1)
            unmet[0::2] = [uploads + saved + int(n == 1 and run > 0)] + [1 + saved] * (size - 1)
            unmet[1::2] = [2] * size
        else:  # one task per microbatch; its number 2p waits for nothing that ever comes
            unmet[0::2] = [1] * size
            unmet[1::2] = [int(i > 0) + uploads] + [1 + (i > 0)] * (size - 1)
        self._runs[key] = after, unmet
        return after, unmet


def _split_tails(slot_ms: Sequence[float], split: Split, graph: SplitGraph, num_devices: int) -> list[float]:
    """`_tails` for `split_ms`: per device all its work, then the least `Split.tails` of its runs."""
    after_slot = split.tails(slot_ms)
    tail = [math.inf] * num_devices
    work = [0.0] * num_devices
    s_count = graph.s_count
    for run, size in enumerate(graph.sizes):
        d, i = run % num_devices, run % s_count
        tail[d] = min(tail[d], after_slot[i])
        work[d] += slot_ms[i] * size
    return [w + x if x < math.inf else 0.0 for w, x in zip(work, tail, strict=True)]
