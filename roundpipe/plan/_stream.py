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

import itertools
import math
from collections.abc import Sequence

from roundpipe.plan import native
from roundpipe.plan._event_loop import event_loop
from roundpipe.plan._stream_graph import Shape, _runs_structure, _structure


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
