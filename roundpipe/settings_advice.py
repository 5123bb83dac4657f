"""Settings that leave devices idle, said once with the value that does not.

Why: a round sends every microbatch through every slot, slot i of a round on device
(g0 + i) mod N, so microbatches that are not a multiple of the device count leave some device
without work in every round, and a batch that does not split evenly into microbatches makes the
largest microbatch set the pace of every stage. Either trains to the same loss, only slower
(on ``cpu:2``, ``--microbatches 3 --batch-size 16`` takes about half as long again as the default
4), and nothing else would tell. This module only does arithmetic on the counts: it never
imports torch, never plans, and never refuses a setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from roundpipe.plan.costs import LayerCosts

# Advice only for a gain worth a flag: the schedule's own noise is well under this.
MIN_GAIN = 0.05


def _better_microbatches(microbatches: int, devices: int, batch_size: int | None) -> int | None:
    """The multiple of ``devices`` nearest ``microbatches`` (the larger on a tie) that splits
    ``batch_size`` evenly when one is given, among those up to ``batch_size``."""
    top = batch_size if batch_size is not None else max(2 * microbatches, devices)
    candidates = [m for m in range(devices, top + 1, devices)]
    if batch_size is not None:
        candidates = [m for m in candidates if batch_size % m == 0] or candidates
    if not candidates:
        return None
    return min(candidates, key=lambda m: (abs(m - microbatches), -m))


def microbatch_advice(
    microbatches: int,
    devices: int,
    batch_size: int | None = None,
    *,
    ms_per_microbatch: Callable[[int], float] | None = None,
    flag: str = "--microbatches",
) -> str | None:
    """One sentence on how ``microbatches`` (of ``batch_size`` rows, when known) wastes
    ``devices``, with the better value; None when it does not. ``ms_per_microbatch(m)``, when
    given, is the planner's iteration time over ``m`` for a run of ``m`` microbatches of the same
    cost (the batch's work per microbatch): the advice is given only when it shows the better
    value at least `MIN_GAIN` faster, and says by how much."""
    if devices <= 1 or microbatches < 1:
        return None
    uneven_rounds = microbatches % devices != 0
    uneven_split = batch_size is not None and batch_size % microbatches != 0
    if not (uneven_rounds or uneven_split):
        return None
    better = _better_microbatches(microbatches, devices, batch_size)
    if better is None or better == microbatches:
        return None
    gain = ""
    if ms_per_microbatch is not None:
        now, then = ms_per_microbatch(microbatches), ms_per_microbatch(better)
        if not now > 0 or then > now * (1 - MIN_GAIN):
            return None
        gain = f", about {1 - then / now:.0%} less time per step by the planner's simulation"
    why = []
    if uneven_rounds:
        why.append(f"{microbatches} is not a multiple of the {devices} devices, so one waits in every round")
    if uneven_split:
        why.append(f"{batch_size} rows do not split evenly into {microbatches}")
    rows = (
        f" of {batch_size // better} rows each" if batch_size is not None and batch_size % better == 0 else ""
    )
    return (
        f"{flag} {microbatches} wastes device time ({'; '.join(why)}): {flag} {better}{rows} keeps "
        f"{'both' if devices == 2 else f'all {devices}'} devices busy{gain}"
    )


def simulated_ms(costs: LayerCosts, devices: int, async_optimizer: bool) -> Callable[[int], float]:
    """``ms_per_microbatch`` for `microbatch_advice`: the partition of ``costs`` for m
    microbatches run by the engine on the fake backend (two iterations), its makespan over m."""

    def ms(m: int) -> float:
        from roundpipe.plan.partition import partition
        from roundpipe.planning.simulate import simulate

        result = simulate(
            partition(costs, devices, m), costs, devices, m, iterations=2, async_optimizer=async_optimizer
        )
        return float(result.makespan_ms) / m

    return ms


__all__ = ["MIN_GAIN", "microbatch_advice", "simulated_ms"]
