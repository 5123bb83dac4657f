"""One device's coarse stages cut evenly, where the fake engine with the measured link runs it faster.

Why: the coarse one-device plan (`roundpipe.plan.coarse`) cuts each direction greedily, so the
last forward and the last backward stage hold the remainder. On one device an upload overlaps
only the stage computing before it (one stage ahead), and a mixture of experts uploads about as
long as it computes a layer (Qwen3-30B-A3B at 16 x 4,096 tokens: ~26 ms against ~29 ms), so a
one-layer forward stage before a six-layer fused stage leaves most of the fused stage's upload
exposed, and a two-layer last backward stage most of the next iteration's first one. On an H100
that run had 0.31 s of its 5.4 s step in exposed parameter uploads. `evenly_cut` keeps the stage
counts and spreads the layers; on that run's plan and costs the fake engine with the link on
times it 1.5% shorter (`tests/test_even_stages.py`).

The even cut is taken only where, on the run's measured link, it is at least `EVEN_GAIN` faster
than the plan in hand and its predicted peak fits the budget: never slower under that model.

It runs the engine, so it lives in ``planning``; it must never touch a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from roundpipe.config import RunConfig
from roundpipe.plan.coarse import evenly_cut
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.memory import LayerMemory, MemoryPrediction, predict_like
from roundpipe.plan.partition import Plan
from roundpipe.planning.link_plan import link_iteration_ms

EVEN_GAIN = 0.005
"""The share of the iteration the even cut must save on the fake engine to be taken."""


class HeldPlan(Protocol):
    """What `even_cut` reads of the plan in hand (`roundpipe.planning.device_plan.DevicePlan`)."""

    @property
    def plan(self) -> Plan: ...
    @property
    def costs(self) -> LayerCosts: ...
    @property
    def memory(self) -> LayerMemory: ...
    @property
    def prediction(self) -> MemoryPrediction: ...


@dataclass(frozen=True)
class EvenCut:
    """The evenly cut plan, its predicted peak and its time per iteration with the link on."""

    plan: Plan
    prediction: MemoryPrediction
    iteration_ms: float


def even_cut(
    held: HeldPlan,
    budget: int | None,
    config: RunConfig,
    link: tuple[float, tuple[int, ...]],
    iteration_ms: float,
) -> EvenCut | None:
    """`evenly_cut` of one device's plan in hand where it is `EVEN_GAIN` faster than
    ``iteration_ms`` (the held plan's time, one stage uploaded ahead) on the fake engine with
    ``link`` on (GB/s and each layer's uploaded bytes), and its peak, predicted as the held one
    was (`predict_like`), fits ``budget`` (the planning budget; None: any); else None. Plans of
    several devices keep their stages: they are the evaluated choice's."""
    plan, costs = held.plan, held.costs
    if plan.num_devices != 1:
        return None
    even = evenly_cut(plan, costs)
    if (even.fwd_stages, even.bwd_stages) == (plan.fwd_stages, plan.bwd_stages):
        return None
    prediction = predict_like(held.prediction, even, held.memory)
    if budget is not None and not prediction.fits(budget):
        return None
    gbps, param_bytes = link
    ms = link_iteration_ms(
        even,
        costs,
        param_bytes,
        gbps,
        config.num_microbatches,
        async_optimizer=config.async_optimizer,
        round_size=config.round_size,
    )
    if ms > iteration_ms * (1 - EVEN_GAIN):
        return None
    return EvenCut(even, prediction, ms)
