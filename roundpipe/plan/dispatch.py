"""Round-robin dispatch: which device runs which slot of which round, over which microbatches.

The microbatches of an iteration go through the plan's slots in rounds of M_R >= N. Slot i of a
round runs on device (g0 + i) mod N; the next round starts at g0 + S, the device after the last one
used, and so does the next iteration (the caller carries g0), so the stream of stages never
breaks. This module only computes that mapping and the bubble formula; it must never wait, run or
time anything (the scheduler in ``roundpipe.sched`` turns the runs into tasks); `steady_iteration_ms`
only evaluates a model of the stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from roundpipe.errors import PlanError
from roundpipe.plan import _search, native
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.partition import Plan, Slot
from roundpipe.plan.rounds import positive_count, round_sizes

__all__ = [
    "SlotRun",
    "analytic_bubble",
    "busiest_device_ms",
    "busiest_device_share",
    "dispatch",
    "round_sizes",
    "steady_iteration_ms",
]


@dataclass(frozen=True)
class SlotRun:
    """One stage run: ``slot`` of ``round`` in ``iteration`` on ``device``, over a block of microbatches."""

    iteration: int
    round: int
    slot: Slot
    device: int
    microbatches: range


def dispatch(
    plan: Plan,
    num_microbatches: int,
    num_devices: int,
    *,
    iteration: int = 0,
    first_device: int = 0,
    round_size: int | None = None,
) -> tuple[list[SlotRun], int]:
    """Every slot run of one iteration in dispatch order, and the g0 the next iteration starts at."""
    n = positive_count("num_devices", num_devices)
    sizes = round_sizes(num_microbatches, n, round_size)
    if isinstance(first_device, bool) or not isinstance(first_device, int) or not 0 <= first_device < n:
        raise PlanError(f"first_device must be a device index in 0..{n - 1}, got {first_device!r}")
    slots = plan.slots
    runs: list[SlotRun] = []
    g0 = first_device
    start = 0
    for r, size in enumerate(sizes):
        block = range(start, start + size)
        runs.extend(SlotRun(iteration, r, slot, (g0 + slot.index) % n, block) for slot in slots)
        g0 = (g0 + len(slots)) % n
        start += size
    return runs, g0


def busiest_device_ms(
    plan: Plan, num_microbatches: int, num_devices: int, *, round_size: int | None = None
) -> float:
    """The compute time per iteration of the device round-robin loads most, over the iterations
    after which `dispatch` comes back to device 0: no run, however long, averages less per
    iteration, since that device computes its runs one at a time. Async runs settle at this
    figure or above it, sometimes only after tens of iterations (a device with a little more than
    its share builds a backlog slowly: docs/performance.md, "Settled iterations")."""
    n = positive_count("num_devices", num_devices)
    if len(plan.slot_ms) != plan.num_slots:
        raise PlanError(
            "the plan does not know its slot times; build it with partition() or Plan.from_stages()"
        )
    return busiest_device_share(plan.slot_ms, n, round_sizes(num_microbatches, n, round_size))


def busiest_device_share(slot_ms: Sequence[float], num_devices: int, rounds: Sequence[int]) -> float:
    """`busiest_device_ms` from the slot times and the round sizes (what the ranking models have).
    The ranking takes it of every candidate it reaches (a fifth of its time at 94 layers in
    Python): compiled where `native` was built, the same loop."""
    kernels = native.kernels()
    if kernels is not None:
        return kernels.busiest_share(slot_ms, num_devices, rounds)  # type: ignore[no-any-return]
    n = num_devices
    by_offset = [0.0] * n  # slot time by (slot index mod N): a round starting at g0 puts it on g0 + offset
    for index, ms in enumerate(slot_ms):
        by_offset[index % n] += ms
    load = [0.0] * n
    g0, iterations = 0, 0
    while True:
        for size in rounds:
            for offset, ms in enumerate(by_offset):
                load[(g0 + offset) % n] += size * ms
            g0 = (g0 + len(slot_ms)) % n
        iterations += 1
        if g0 == 0:
            return max(load) / iterations


def analytic_bubble(num_devices: int, num_microbatches: int, num_slots: int) -> float:
    """Idle fraction of a balanced synchronous iteration: N(N-1) / (M*S + N(N-1))."""
    n = positive_count("num_devices", num_devices)
    m = positive_count("num_microbatches", num_microbatches)
    s = positive_count("num_slots", num_slots)
    fill_drain = n * (n - 1)
    return fill_drain / (m * s + fill_drain)


def steady_iteration_ms(
    plan: Plan, num_microbatches: int, num_devices: int, *, round_size: int | None = None
) -> float:
    """Modelled milliseconds per iteration once an async run has settled (no fill, no drain).

    The model (``plan._search.steady_period``) is the round-robin stream of stage runs as a
    max-plus system: a run's first microbatch follows the previous slot's, its device first
    finishes the run N before, and the run 2N before must have ended (one stage of prefetch).
    Transfers and the optimizer are not in it. ``1 - M * sum(plan.slot_ms) / (N * this)`` is the
    steady bubble it predicts. A backward stage recomputes a microbatch before its gradient
    arrives; the plan does not hold per-layer costs, so that lead is its layers' forward time
    estimated from the forward slots (each forward slot's time spread evenly over its layers).
    """
    n = positive_count("num_devices", num_devices)
    rounds = round_sizes(num_microbatches, n, round_size)
    if len(plan.slot_ms) != plan.num_slots:
        raise PlanError(
            "the plan does not know its slot times; build it with partition() or Plan.from_stages()"
        )
    return _search.steady_period(plan.slot_ms, n, rounds, _recompute_lead(plan))


def _recompute_lead(plan: Plan) -> list[float]:
    """Per slot, the estimated time of a microbatch's recompute (0 outside backward stages)."""
    layer_fwd = [0.0] * plan.fused.start
    for layers, ms in zip(plan.fwd_stages, plan.slot_ms, strict=False):
        for layer in layers:
            layer_fwd[layer] = ms / len(layers)
    return [math.fsum(layer_fwd[i] for i in s.layers) if s.kind == SlotKind.BWD else 0.0 for s in plan.slots]
