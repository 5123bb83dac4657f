"""Plans from what the device measured: per-layer times and memory, and the memory budget.

Why a step before the first iteration: a plan made from parameter counts alone puts a whole
model in one fused stage on one GPU, which runs out of memory on a small card (the activations
of every layer for a microbatch, the LM head's logits) and is slower than a split plan. So on
the first `forward_backward` the layers are run once, one at a time, on the first device with
the first microbatch (`roundpipe.backends.profile`), which gives each layer's forward and
backward time and its memory facts at the run's real tokens per microbatch; the plan is then
the best one whose *predicted* device peak (`roundpipe.plan.memory`) stays under the budget.
After the first iteration the times are refined from the device's own timing of every compute
task, and the run is re-planned once.

The budget: `RunConfig.memory_budget`, or on CUDA the free memory at start less a reserve. A
budget below the card's memory is enforced on the device (the caching allocator refuses to go
past it), so a large card can stand in for a 24 GB one.

This module decides nothing about ordering and runs no training step itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn

from roundpipe.config import RunConfig
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan
from roundpipe.plan.coarse import coarsest_plan
from roundpipe.plan.link import LinkReport
from roundpipe.plan.memory import Grain, LayerMemory, MemoryPrediction, layer_plan_bytes, plan_within_budget
from roundpipe.plan.shape import RunShape
from roundpipe.planning.ranking import choose_for_shape


@dataclass(frozen=True)
class DevicePlan:
    """A plan with the measurements it was made from."""

    plan: Plan
    costs: LayerCosts
    memory: LayerMemory
    prediction: MemoryPrediction
    budget_bytes: int | None
    kind: str  # the devices' kind ("cuda", "cpu", "fake")
    link: LinkReport | None = None  # the host link's share of an iteration, once measured (`with_link`)
    grain: Grain = "stage"  # the recompute grain it was planned at (`roundpipe.planning.grain`)
    grain_why: str = ""  # why that grain (`roundpipe.planning.grain.choose_grain`)
    residuals: bool = False  # whether its forward stages save residuals (`model.attention_residual`)


def may_save_residuals(config: RunConfig, kind: str, layers: Sequence[nn.Module]) -> bool:
    """Whether a run of ``config`` on ``kind`` devices may save residuals
    (`roundpipe.model.attention_residual`): a layer of ``layers`` can keep one, and the grain is a
    named layer_input or one "auto" may choose (`roundpipe.planning.grain`). Its profile keeps
    them then, as its forward stages would; until a device plan says, the run saves them where
    its grain is layer_input."""
    from roundpipe.model.attention_residual import supported
    from roundpipe.planning.grain import auto_may_take_layer_input

    if not (config.save_residuals and config.skip_unread_tail and any(map(supported, layers))):
        return False
    grain = config.recompute_grain
    return grain == "layer_input" or (grain == "auto" and auto_may_take_layer_input(layers, kind))


def planning_config(config: RunConfig, kind: str) -> RunConfig:
    """The config the planner and graph use. On CUDA, unless the user chose a round size, one
    round per iteration: every round uploads every stage's weights and downloads its gradients
    over the host link, so more rounds multiply that traffic, while the only cost of a longer
    round is host memory for the boundary activations of its microbatches."""
    if kind == "cuda" and config.round_size is None:
        return config.model_copy(update={"round_size": config.num_microbatches})
    return config


def resolve_budget(config: RunConfig, kind: str, indices: tuple[int, ...]) -> int | None:
    """The per-device budget in bytes (None: unlimited), enforced on CUDA devices when it is
    below what the card has. Called before anything is allocated on the devices."""
    budget = config.memory_budget_bytes()
    if kind != "cuda":
        return budget
    from roundpipe.backends.budget import default_budget, enforce_budget, require_devices

    require_devices(indices)
    _limit_fragmentation()
    if budget is None:
        budget = min(default_budget(index) for index in indices)
    for index in indices:
        if budget < torch.cuda.get_device_properties(index).total_memory:
            enforce_budget(index, budget)
    return budget


def budget_release(spec: Any, budget: int | None) -> Callable[[], None]:
    """What lifts the cap `resolve_budget` set on ``spec``'s devices (a `DeviceSpec`)."""
    return functools.partial(release_budget, spec.kind, spec.indices, budget)


def release_budget(kind: str, indices: tuple[int, ...], budget: int | None) -> None:
    """Lift the cap `resolve_budget` put on the devices (when the pipe closes): the process may
    go on to other work, or another pipe with another budget."""
    if kind != "cuda" or budget is None or not torch.cuda.is_available():
        return
    for index in indices:
        if budget < torch.cuda.get_device_properties(index).total_memory:
            torch.cuda.set_per_process_memory_fraction(1.0, index)


def _limit_fragmentation() -> None:
    """Expandable segments, unless the user configured the allocator: the budget caps what the
    caching allocator *reserves*, and with fixed segments a few differently sized large blocks
    (an LM head's logits chunks, gradients) strand far more than the plan's allocated bytes."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    # The old name is now a deprecated wrapper of this one (a FutureWarning per call).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )
    if setter is not None:
        setter("expandable_segments:True")


def planning_budget(budget_bytes: int, kind: str) -> int:
    """The part of a device budget the plan's predicted peak may use. On CUDA the rest absorbs
    what the prediction does not count (the allocator's rounding and reserved-but-unallocated
    blocks, library workspaces, compiled kernels' buffers)."""
    if kind != "cuda":
        return budget_bytes
    # An eighth, at least 192 MiB: the cap applies to what the allocator reserves (a small run's
    # reserved-but-unallocated blocks were measured at 115 MiB under a 433 MiB budget), and on an
    # H200 fused stages with the LM head peaked up to 7% above their prediction (B sync under 12
    # GiB, A under 8 GiB) while whole runs stayed within 2% (A and B async under 12 GiB).
    return budget_bytes - max(192 << 20, budget_bytes // 8)


def profile_and_plan(
    config: RunConfig,
    sequence: Any,
    dtype: torch.dtype,
    device: torch.device,
    num_devices: int,
    sample: Any,
    target: Any,
    loss_fn: Any,
    budget_bytes: int | None,
    keep_residuals: bool,
    prepare: Any = None,
) -> DevicePlan:
    """Measure every layer (or one of each kind: ``config.profile``) on ``device`` with one microbatch,
    each copy readied by ``prepare`` as the run's replicas are, with residuals where the run may
    save them (``keep_residuals``, from `may_save_residuals`), and plan within the budget."""
    from roundpipe.backends.profile import profile_layers

    memory, fwd_ms, bwd_ms = profile_layers(
        sequence.layers,
        sample,
        device,
        loss_fn=loss_fn,
        target=target,
        computes_loss=sequence.computes_loss,
        dtype=dtype,
        names=sequence.names,
        prepare=prepare,
        one_per_kind=config.profile == "one_per_kind",
        keep_residuals=keep_residuals,
    )
    from roundpipe.optim.host_room import available_host_bytes
    from roundpipe.plan.rounds import round_sizes
    from roundpipe.planning.dequantize import plan_dequantizing
    from roundpipe.planning.grain import choose_grain, host_room
    from roundpipe.planning.host_activations import saved_activation_bytes

    def plan_at(grain: Grain, residuals: bool) -> DevicePlan:
        at = config.model_copy(update={"recompute_grain": grain})

        def plan_with(counted: LayerMemory) -> DevicePlan:
            costs = LayerCosts(
                tuple(max(ms, 1e-3) for ms in fwd_ms),
                tuple(max(ms, 1e-3) for ms in bwd_ms),
                layer_plan_bytes(counted, grain),
                tuple(sequence.names),
            )
            return plan_from(at, costs, counted, num_devices, budget_bytes, device.type)

        counted = memory if residuals and grain == "layer_input" else memory.without_residuals()
        return plan_dequantizing(at, counted, plan_with, sequence.layers, dtype)

    def saved_bytes(device_plan: DevicePlan) -> int:
        round_microbatches = max(round_sizes(config.num_microbatches, num_devices, config.round_size))
        slots, grain, pinned = device_plan.plan.slots, device_plan.grain, device_plan.kind == "cuda"
        return saved_activation_bytes(slots, device_plan.memory, grain, round_microbatches, pinned)[0]

    room = host_room(available_host_bytes()) if config.recompute_grain == "auto" else None
    chosen, why = choose_grain(config, sequence.layers, device.type, plan_at, saved_bytes, room)
    return replace(chosen, grain_why=why)


FLOW_DEPTH = 2
"""Microbatches a stage run's inputs are uploaded ahead of its computes (`ScheduleOptions.flow_depth`),
counted in the memory prediction (``act_in_flight``); where no plan fits with them, two. Deeper
lets the host issue more of a stage's computes before the stage's weights have landed, for one
more activation on the device per microbatch. On an H100, Qwen3-30B-A3B at 16 x 4,096 tokens ran
1.1% faster at four (one run each; the host still the bound), and the fake stream backend ranks
it from 15% faster to slower by stage size (`bench/flow_depth.py`), so two stays the default
(`bench/gpu_throughput.py --flow-depth`)."""

STAGES_ON_ONE_DEVICE: Literal["balanced", "coarse"] = "coarse"
"""How a plan under a memory budget on one device cuts its stages: "coarse", the fewest stages
that fit (`roundpipe.plan.coarse`), where that has fewer slots than the evaluated choice;
"balanced", the evaluated choice (`choose_for_shape`), which on one device falls to the finest
stages the budget allows (every plan computes the same there). Coarse issues fewer compute tasks
and sends fewer activations over the link: on an H100, Qwen3-30B-A3B at 16 x 4,096 tokens ran
11,500 tok/s in 17 slots against 7,009 in 70 (docs/performance.md; `gpu_throughput.py
--one-device-stages`)."""

BACKWARD_STAGE_LAYERS: int | None = None
"""The most layers of a coarse plan's backward stage (None: as many as fit): shorter ones skip more
frozen tails in their recomputes (`roundpipe.model.frozen_tail`), for more slots (docs/design.md)."""


def plan_from(
    config: RunConfig,
    costs: LayerCosts,
    memory: LayerMemory,
    num_devices: int,
    budget_bytes: int | None,
    kind: str = "cpu",
) -> DevicePlan:
    """The best plan for ``costs`` whose predicted peak fits ``budget_bytes`` (any, when None); it
    saves residuals where ``memory`` counts them (`LayerMemory.without_residuals` where not)."""
    from roundpipe.plan.in_flight import in_flight_microbatches
    from roundpipe.plan.memory import predict_peak
    from roundpipe.planning.grain import initial_grain

    shape = RunShape(
        num_devices, config.num_microbatches, config.async_optimizer, config.round_size, config.loss_lag
    )

    def make_plan(limit: int | None) -> Plan:
        return choose_for_shape(_capped(costs, limit), shape, limit)

    grain = initial_grain(config)
    saves = grain == "layer_input" and any(memory.residual_bytes)  # counted only where saved
    in_flight = in_flight_microbatches(config.num_microbatches, FLOW_DEPTH)
    if budget_bytes is None:
        plan = make_plan(None)
        prediction = predict_peak(plan, memory, grain, num_devices=num_devices, act_in_flight=in_flight)
        return DevicePlan(plan, costs, memory, prediction, budget_bytes, kind, grain=grain, residuals=saves)
    budget = planning_budget(budget_bytes, kind)
    fit = functools.partial(
        _within_budget, memory=memory, budget=budget, grain=grain, num_devices=num_devices
    )
    try:
        plan, prediction = fit(make_plan, in_flight=in_flight)
    except PlanError:
        if in_flight <= in_flight_microbatches(config.num_microbatches):
            raise
        in_flight = in_flight_microbatches(config.num_microbatches)  # the default depth, which fits more
        plan, prediction = fit(make_plan, in_flight=in_flight)
    if num_devices == 1 and STAGES_ON_ONE_DEVICE != "balanced":
        coarse = _coarse_within_budget(costs, memory, budget, grain, in_flight, config.num_microbatches)
        fewer = coarse is not None and coarse[0].num_slots < plan.num_slots
        if coarse is not None and (fewer or BACKWARD_STAGE_LAYERS is not None):
            plan, prediction = coarse
    return DevicePlan(plan, costs, memory, prediction, budget_bytes, kind, grain=grain, residuals=saves)


def _coarse_within_budget(
    costs: LayerCosts, memory: LayerMemory, budget: int, grain: Any, in_flight: int, num_microbatches: int
) -> tuple[Plan, MemoryPrediction] | None:
    """The coarsest plan (`coarsest_plan`) whose predicted peak fits ``budget``, None when none
    does: the largest stage limit that fits, by bisection (a larger limit cuts no finer)."""
    from roundpipe.plan.memory import predict_peak

    def attempt(limit: int) -> tuple[Plan, MemoryPrediction] | None:
        try:
            plan = coarsest_plan(_capped(costs, limit), num_microbatches, limit, BACKWARD_STAGE_LAYERS)
        except PlanError:
            return None
        prediction = predict_peak(plan, memory, grain, act_in_flight=in_flight, num_devices=1)
        return (plan, prediction) if prediction.fits(budget) else None

    best, low, high = None, 2, 2 * budget + 2  # no stage needs a limit past twice the budget
    while high - low > max(1, high >> 10):  # to a thousandth
        middle = (low + high) // 2
        found = attempt(middle)
        if found is None:
            high = middle
        else:
            best, low = found, middle
    return best


def _capped(costs: LayerCosts, limit: int | None) -> LayerCosts:
    """``costs`` for a plan under ``limit``: a layer whose bound alone exceeds a stage's share (an
    LM head with its logits and gradients) is still a stage of its own: the exact prediction
    judges it, and capping it lets the search keep cutting the other stages smaller."""
    if limit is None:
        return costs
    return replace(costs, mem_bytes=tuple(min(b, limit // 2) for b in costs.mem_bytes))


def _within_budget(
    make_plan: Callable[[int], Plan],
    *,
    memory: LayerMemory,
    budget: int,
    grain: Any,
    num_devices: int,
    in_flight: int,
) -> tuple[Plan, MemoryPrediction]:
    """`plan_within_budget`, uploading each backward stage's next input ahead where a plan fits so."""
    try:
        return plan_within_budget(
            make_plan, memory, budget, grain, num_devices=num_devices, act_in_flight=in_flight
        )
    except PlanError as uploading_ahead:
        # A backward stage's next input uploaded while it computes is one more activation on the
        # device; without it the upload waits, exposed (one activation over the link per stage
        # run, small beside the compute of microbatches this large).
        try:
            return plan_within_budget(
                make_plan,
                memory,
                budget,
                grain,
                num_devices=num_devices,
                act_in_flight=in_flight,
                inputs_ahead=False,
            )
        except PlanError:
            raise uploading_ahead from None
