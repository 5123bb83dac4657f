"""One device's coarse stages cut evenly, the fused stage as long as fits, where the fake engine
with the measured link runs it faster.

Why: the coarse one-device plan (`roundpipe.plan.coarse`) cuts each direction greedily, so the
last forward and the last backward stage hold the remainder. On one device an upload overlaps
only the stage computing before it (one stage ahead), and a mixture of experts uploads about as
long as it computes a layer (Qwen3-30B-A3B at 16 x 4,096 tokens: ~26 ms against ~29 ms), so a
one-layer forward stage before a six-layer fused stage leaves most of the fused stage's upload
exposed, and a two-layer last backward stage most of the next iteration's first one. On an H100
that run had 0.31 s of its 5.4 s step in exposed parameter uploads. `evenly_cut` keeps the stage
counts and spreads the layers; on that run's plan and costs the fake engine with the link on
times it 1.5% shorter (`tests/test_even_stages.py`).

The greedy cut also gives the fused stage the cap of every stage, half the limit, as if the stage
uploaded behind each were as large as it. On a 4-bit base made dense once a run the upload is a
quarter of that: on one H100 under 24 GiB a Qwen3-32B shape in nf4 planned a fused stage of 7
layers at 16.5 GiB (bf16: 8 at 20.0) under a 21 GiB planning budget, though each layer more in the
fused stage is one layer's forward less per microbatch (computed once with grad, not in a forward
stage and again in a recompute). So the fused stage is tried longer too, one layer at a time from
the plan's, while the predicted peak fits and the fake engine runs it faster.

The cut is taken only where, on the run's measured link, it is at least `EVEN_GAIN` faster than
the plan in hand and its predicted peak fits the budget: never slower under that model.

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

MAX_FUSED_GROWTH = 16
"""The most layers the even cut adds to the fused stage (each one more costs a run of the fake engine)."""


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
    """The fastest `evenly_cut` of one device's plan in hand, its fused stage as in the plan or
    longer by up to `MAX_FUSED_GROWTH` layers (module docstring), on the fake engine with ``link``
    on (GB/s and each layer's uploaded bytes), where it is `EVEN_GAIN` faster than
    ``iteration_ms`` (the held plan's time, one stage uploaded ahead) and its peak, predicted as the
    held one was (`predict_like`), fits ``budget`` (the planning budget; None: any); else None.
    The fused stage grows while each longer one fits and runs faster than the one before. Plans
    of several devices keep their stages: they are the evaluated choice's."""
    plan = held.plan
    if plan.num_devices != 1:
        return None
    best: EvenCut | None = None
    shortest = max(len(plan.fwd_stages), len(plan.bwd_stages), 1)
    for fused_start in range(plan.fused.start, max(shortest, plan.fused.start - MAX_FUSED_GROWTH) - 1, -1):
        cut = _timed_cut(held, fused_start, budget, config, link)
        if cut is None or (best is not None and cut.iteration_ms >= best.iteration_ms):
            if fused_start < plan.fused.start:
                break  # a longer fused stage no longer fits, or gains no more
            continue
        best = cut
    if best is None or best.iteration_ms > iteration_ms * (1 - EVEN_GAIN):
        return None
    return best


def _timed_cut(
    held: HeldPlan,
    fused_start: int,
    budget: int | None,
    config: RunConfig,
    link: tuple[float, tuple[int, ...]],
) -> EvenCut | None:
    """`evenly_cut` of the held plan with its fused stage from ``fused_start``, predicted and
    timed, or None where it is the held plan itself or its peak does not fit ``budget``."""
    plan, costs = held.plan, held.costs
    even = evenly_cut(plan, costs, fused_start)
    if (even.fwd_stages, even.fused, even.bwd_stages) == (plan.fwd_stages, plan.fused, plan.bwd_stages):
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
    return EvenCut(even, prediction, ms)
