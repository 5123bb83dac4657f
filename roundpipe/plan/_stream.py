"""A fast model of the round-robin stream: the compute tasks of a plan, list-scheduled per device.

`choose_plan` ranks its candidate plans with it before the engine evaluates the best few, so it
must be cheap: one heap event per microbatch of each stage run, no transfers, no optimizer. It
mirrors the engine's compute lanes: run k of the stream (slot k mod S of its round) goes to device
k mod N; microbatch j of a run is ready when the run's microbatch j-1 is done, microbatch j has
left the previous slot, (prefetch of one stage) the device's run k-2N has ended and (async) the
gradients of its layers two iterations back are in; a free device
starts its ready task that comes first in dispatch order. It is a model, not the engine: the
engine's graphs can hold more (transfers, a backward stage's recompute ahead of its gradient,
which makes the engine up to ~2.5% faster than this model on backward-heavy sync plans), which is
why the engine has the last word. Splitting a backward microbatch here into its recompute and the
rest was tried: it ranked 7 of 48 grid shapes (28 layers, sync) better and 3 worse. Plain floats only: it must never build plans or import torch or the scheduler.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

# Between two computes the engine runs transfer and optimizer tasks, which take no time here but
# still come after the compute that freed a device: a device freed at time T starts what was ready
# before the transfers that T's completions set off. Each dependency counts its tasks in between.
_ACTIVATION_HOPS = 2  # act_down, act_up
_PARAM_HOPS = 1  # param_up (one stage of prefetch)
_WEIGHT_HOPS = 5  # grad_down, G-copy, step, P-copy, param_up


def _build(
    slot_ms: Sequence[float],
    num_devices: int,
    rounds: Sequence[int],
    iterations: int,
    weight_waits: Sequence[Sequence[int]] | None,
) -> tuple[list[float], list[int], list[int], list[list[tuple[int, int]]], list[int]]:
    """Every microbatch task in dispatch order: duration, device, unmet deps, dependents, and
    where each run's tasks begin."""
    n = num_devices
    duration: list[float] = []
    device: list[int] = []
    run_start: list[int] = []
    k = 0
    for _ in range(iterations):
        for size in rounds:
            for ms in slot_ms:
                run_start.append(len(duration))
                duration.extend([ms] * size)
                device.extend([k % n] * size)
                k += 1
    run_start.append(len(duration))
    count = len(duration)
    unmet = [0] * count
    after: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    s_count = len(slot_ms)
    for run in range(k):
        first, stop = run_start[run], run_start[run + 1]
        for t in range(first + 1, stop):  # the run's previous microbatch
            after[t - 1].append((t, 0))
            unmet[t] += 1
        if run % s_count:  # the same microbatch at the previous slot of the round
            prev = run_start[run - 1]
            for j in range(stop - first):
                after[prev + j].append((first + j, _ACTIVATION_HOPS))
                unmet[first + j] += 1
        if run >= 2 * n:  # one stage of prefetch: the device's run before last has ended
            after[run_start[run - 2 * n + 1] - 1].append((first, _PARAM_HOPS))
            unmet[first] += 1
    per = s_count * len(rounds)
    if weight_waits is not None:  # async: iteration t reads the weights stepped after iteration t-2
        for run in range(2 * per, k):
            first = run_start[run]
            base = (run // per - 2) * per
            for slot in weight_waits[run % s_count]:
                for r in range(len(rounds)):
                    after[run_start[base + r * s_count + slot + 1] - 1].append((first, _WEIGHT_HOPS))
                    unmet[first] += 1
    return duration, device, unmet, after, run_start


def stream_ms(
    slot_ms: Sequence[float],
    num_devices: int,
    rounds: Sequence[int],
    *,
    iterations: int = 1,
    window: tuple[int, int] | None = None,
    weight_waits: Sequence[Sequence[int]] | None = None,
) -> float:
    """Modelled ms per iteration: the makespan of ``iterations`` chained iterations (fill and drain
    included), or with ``window=(a, b)`` the time from iteration a's first compute to iteration b's,
    over b - a (the steady time of an async run; needs ``iterations > b``).

    ``weight_waits[i]`` (async runs): the slots whose gradients slot i's weights wait for, two
    iterations back (the backward and fused slots that hold slot i's layers)."""
    duration, device, unmet, after, run_start = _build(slot_ms, num_devices, rounds, iterations, weight_waits)
    now, start = _list_schedule(duration, device, unmet, after, num_devices)
    if window is None:
        return now
    per = len(rounds) * len(slot_ms)
    a, b = window
    return (start[run_start[b * per]] - start[run_start[a * per]]) / (b - a)


def _list_schedule(
    duration: list[float],
    device: list[int],
    unmet: list[int],
    after: list[list[tuple[int, int]]],
    num_devices: int,
) -> tuple[float, list[float]]:
    """Run the tasks of `_build`: a free device starts its ready task first in dispatch order.
    Returns when the last ends and when each started."""
    ready: list[list[int]] = [[] for _ in range(num_devices)]
    busy = [False] * num_devices
    start = [0.0] * len(duration)
    # Computes that end: (time, task). Dependencies met after the transfers in between (hops) come
    # at the time of the compute they follow, after every compute ending then, by (hops, task):
    # they wait in `met` as hops * K + task.
    ends: list[tuple[float, int]] = []
    met: list[int] = []
    k = len(duration)
    heappush, heappop = heapq.heappush, heapq.heappop
    for t, left in enumerate(unmet):
        if not left:
            heappush(ready[device[t]], t)
    now = 0.0
    touched = list(range(num_devices))
    while True:
        for d in touched:
            if not busy[d] and ready[d]:
                t = heappop(ready[d])
                busy[d] = True
                start[t] = now
                heappush(ends, (now + duration[t], t))
        touched = []
        if ends and (ends[0][0] == now or not met):
            now, t = heappop(ends)
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
        for u, hops in after[t]:
            if hops:
                heappush(met, hops * k + u)
                continue
            unmet[u] -= 1
            if not unmet[u]:
                heappush(ready[device[u]], u)
                touched.append(device[u])
    return now, start


def weight_waits(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> list[list[int]]:
    """For each slot (dispatch order ``fwd, fused, bwd``), the fused and backward slots that hold
    one of its layers: an async iteration's upload of a layer waits for the step of two iterations
    back, which waits for that layer's gradients."""
    grads = [(len(fwd), fused)] + [(len(fwd) + 1 + j, r) for j, r in enumerate(bwd)]
    return [
        [slot for slot, held in grads if held.start < layers.stop and layers.start < held.stop]
        for layers in (*fwd, fused, *bwd)
    ]
