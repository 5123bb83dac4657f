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

Where the runs hold dense copies of a 4-bit base by ``RunConfig.dequantize="auto"`` (``"run"``
asks for copies in every run), the fused stage is also tried dequantizing in each call, every
other run keeping its copies. A fused run computes each microbatch's forward and backward at
once, so the copies save it seven dequantizations of each weight in eight at four microbatches
(~4.9 ms a Qwen3-32B layer an iteration at `DEQUANTIZE_GBPS`; the model charges all eight), while
without them the stage holds a quarter of the bytes (0.28 GB against 1.25 a layer) and takes more
layers, each one forward of four microbatches (~28 ms) less to recompute.

The cut is taken only where, on the run's measured link, it is at least `EVEN_GAIN` faster than
the plan in hand and its predicted peak fits the budget: never slower under that model.

It runs the engine, so it lives in ``planning``; it must never touch a device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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

DEQUANTIZE_GBPS = 1400.0
"""Dense bytes a 4-bit weight's dequantization writes per second on CUDA, in GB/s, to time a
fused stage that dequantizes in each call. On one H100 (`bash bench/gpu_big.sh E-nf4 E`, one call)
the profile, which calls every layer per call, timed a Qwen3-32B layer's forward 0.90 ms and its
backward 0.52 ms longer in nf4 than in bf16: 1.42 ms a microbatch for 0.97 GB written twice,
1,370 GB/s (the kernel alone: 1,680-1,925 on the MLP projections, 840-970 on o_proj,
`python bench/gpu_nf4.py`)."""


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
    """The evenly cut plan, its predicted peak, its time per iteration with the link on, and the
    memory table it was predicted on (the held plan's, or with the fused stage's dense copies left
    out: `fused_per_call`; the runtime follows it)."""

    plan: Plan
    prediction: MemoryPrediction
    iteration_ms: float
    memory: LayerMemory


def even_cut(
    held: HeldPlan,
    budget: int | None,
    config: RunConfig,
    link: tuple[float, tuple[int, ...]],
    iteration_ms: float,
) -> EvenCut | None:
    """The fastest `evenly_cut` of one device's plan in hand, its fused stage as in the plan or
    longer by up to `MAX_FUSED_GROWTH` layers (module docstring), and where the plan's runs hold
    dense copies of a 4-bit base by ``dequantize="auto"``, also with the fused stage dequantizing
    in each call (`fused_per_call`), on the fake engine with ``link`` on (GB/s and each layer's uploaded
    bytes), where it is `EVEN_GAIN` faster than ``iteration_ms`` (the held plan's time, one stage
    uploaded ahead) and its peak, predicted as the held one was (`predict_like`), fits ``budget``
    (the planning budget; None: any); else None. Plans of several devices keep their stages: they
    are the evaluated choice's."""
    if held.plan.num_devices != 1:
        return None
    best: EvenCut | None = None
    may_call = any(held.memory.dense_bytes) and config.dequantize == "auto"  # "run": every run copies
    for per_call in (False, True) if may_call else (False,):
        best = _longest_fused(held, budget, config, link, per_call, best)
    if best is None or best.iteration_ms > iteration_ms * (1 - EVEN_GAIN):
        return None
    return best


def _longest_fused(
    held: HeldPlan,
    budget: int | None,
    config: RunConfig,
    link: tuple[float, tuple[int, ...]],
    per_call: bool,
    best: EvenCut | None,
) -> EvenCut | None:
    """``best``, or a faster cut whose fused stage is the held plan's or longer (dequantizing in
    each call where ``per_call``): it grows while each longer one fits and runs faster than the
    one before."""
    plan = held.plan
    last: EvenCut | None = None
    shortest = max(len(plan.fwd_stages), len(plan.bwd_stages), 1)
    for fused_start in range(plan.fused.start, max(shortest, plan.fused.start - MAX_FUSED_GROWTH) - 1, -1):
        cut = _timed_cut(held, fused_start, budget, config, link, per_call)
        if cut is None or (last is not None and cut.iteration_ms >= last.iteration_ms):
            if fused_start < plan.fused.start:
                break  # a longer fused stage no longer fits, or gains no more
            continue
        last = cut
        if best is None or cut.iteration_ms < best.iteration_ms:
            best = cut
    return best


def fused_per_call(
    memory: LayerMemory, costs: LayerCosts, fused_start: int
) -> tuple[LayerMemory, LayerCosts]:
    """The memory table and costs of a plan whose fused stage, from ``fused_start`` to the last
    layer, dequantizes its 4-bit weights in each call while every other run holds dense copies:
    no copies counted for its layers (the profile's working sets hold a call's dense transient),
    and each of their forward and backward calls one dequantization longer (its dense bytes
    written at `DEQUANTIZE_GBPS`)."""
    last = costs.num_layers
    extra = [0.0] * fused_start + [
        memory.dense_bytes[i] / (DEQUANTIZE_GBPS * 1e6) for i in range(fused_start, last)
    ]
    dense = tuple(held if i < fused_start else 0 for i, held in enumerate(memory.dense_bytes))
    timed = replace(
        costs,
        fwd_ms=tuple(ms + more for ms, more in zip(costs.fwd_ms, extra, strict=True)),
        bwd_ms=tuple(ms + more for ms, more in zip(costs.bwd_ms, extra, strict=True)),
    )
    return replace(memory, dense_bytes=dense), timed


def _timed_cut(
    held: HeldPlan,
    fused_start: int,
    budget: int | None,
    config: RunConfig,
    link: tuple[float, tuple[int, ...]],
    per_call: bool,
) -> EvenCut | None:
    """`evenly_cut` of the held plan with its fused stage from ``fused_start`` (dequantizing in
    each call where ``per_call``), predicted and timed, or None where it is the held plan itself
    or its peak does not fit ``budget``."""
    plan = held.plan
    memory, costs = (
        fused_per_call(held.memory, held.costs, fused_start) if per_call else (held.memory, held.costs)
    )
    even = evenly_cut(plan, costs, fused_start)
    if not per_call and even.fused == plan.fused:
        if even.fwd_stages == plan.fwd_stages and even.bwd_stages == plan.bwd_stages:
            return None
    prediction = predict_like(held.prediction, even, memory)
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
    return EvenCut(even, prediction, ms, memory)
