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
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from roundpipe.config import RunConfig
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan
from roundpipe.plan.link import LinkReport
from roundpipe.plan.memory import LayerMemory, MemoryPrediction, layer_plan_bytes, plan_within_budget
from roundpipe.plan.shape import RunShape
from roundpipe.planning.ranking import choose_for_shape
from roundpipe.sched.trace import Trace


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
    *,
    prepare: Any = None,
) -> DevicePlan:
    """Measure every layer (or one of each kind: ``config.profile``) on ``device`` with one
    microbatch and plan within the budget (``prepare`` readies each layer copy as the run's
    replicas are: compiled or not)."""
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
    )
    costs = LayerCosts(
        tuple(max(ms, 1e-3) for ms in fwd_ms),
        tuple(max(ms, 1e-3) for ms in bwd_ms),
        layer_plan_bytes(memory, config.recompute_grain),
        tuple(sequence.names),
    )
    return plan_from(config, costs, memory, num_devices, budget_bytes, device.type)


def plan_from(
    config: RunConfig,
    costs: LayerCosts,
    memory: LayerMemory,
    num_devices: int,
    budget_bytes: int | None,
    kind: str = "cpu",
) -> DevicePlan:
    """The best plan for ``costs`` whose predicted peak fits ``budget_bytes`` (any, when None)."""
    from roundpipe.plan.memory import in_flight_microbatches, predict_peak

    shape = RunShape(
        num_devices, config.num_microbatches, config.async_optimizer, config.round_size, config.loss_lag
    )

    def make_plan(limit: int | None) -> Plan:
        # A layer whose bound alone exceeds a stage's share (an LM head with its logits and
        # gradients) is still a stage of its own: the exact prediction judges it, and capping it
        # lets the search keep cutting the other stages smaller.
        capped = (
            costs
            if limit is None
            else replace(costs, mem_bytes=tuple(min(b, limit // 2) for b in costs.mem_bytes))
        )
        return choose_for_shape(capped, shape, limit)

    grain = config.recompute_grain
    in_flight = in_flight_microbatches(config.num_microbatches)
    if budget_bytes is None:
        plan = make_plan(None)
        prediction = predict_peak(plan, memory, grain, num_devices=num_devices, act_in_flight=in_flight)
        return DevicePlan(plan, costs, memory, prediction, budget_bytes, kind)
    budget = planning_budget(budget_bytes, kind)
    try:
        plan, prediction = plan_within_budget(
            make_plan, memory, budget, grain, num_devices=num_devices, act_in_flight=in_flight
        )
    except PlanError as uploading_ahead:
        # A backward stage's next input uploaded while it computes is one more activation on the
        # device; without it the upload waits, exposed (one activation over the link per stage
        # run, small beside the compute of microbatches this large).
        try:
            plan, prediction = plan_within_budget(
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
    return DevicePlan(plan, costs, memory, prediction, budget_bytes, kind)


REPLAN_AFTER_ITERATIONS = 2
"""A plan made from measured layers is re-planned once this many iterations have run: the first
compiles and warms up, so the timings come from the second (`refined_costs`)."""


def refined_costs(trace: Trace, costs: LayerCosts, since_iteration: int = 1) -> LayerCosts | None:
    """Costs scaled so that each stage kind's compute tasks of iterations >= ``since_iteration``,
    as the device timed them in ``trace``, match what the costs predict for them; None when
    nothing was timed. The first iteration never counts: it compiles each layer kind's graphs and
    warms the allocator (on an H200, A's first-iteration forward tasks took 9x their steady time
    and its backward tasks 2x, and a re-plan from them took forward stages for ten times dearer
    than they are)."""
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    for task in trace:
        if task.kind not in ("compute", "recompute") or task.end_t < task.start_t or not len(task.layers):
            continue
        if task.iteration < since_iteration:
            continue
        kind = str(task.stage_kind)
        if kind == "fwd":
            model = costs.fwd_stage_ms(task.layers)
        elif kind == "fused":
            model = costs.fused_stage_ms(task.layers)
        elif task.kind == "recompute":  # a backward stage's two tasks share its forward + backward
            model = costs.fwd_stage_ms(task.layers)
        else:
            model = costs.bwd_stage_ms(task.layers) - costs.fwd_stage_ms(task.layers)
        measured[kind] = measured.get(kind, 0.0) + task.end_t - task.start_t
        predicted[kind] = predicted.get(kind, 0.0) + model
    if not measured:
        return None
    total = sum(measured.values()) / max(sum(predicted.values()), 1e-9)
    fwd_scale = measured["fwd"] / predicted["fwd"] if predicted.get("fwd") else total
    rest_measured = sum(v for k, v in measured.items() if k != "fwd")
    rest_predicted = sum(v for k, v in predicted.items() if k != "fwd")
    bwd_scale = rest_measured / rest_predicted if rest_predicted else total
    return LayerCosts(
        tuple(ms * fwd_scale for ms in costs.fwd_ms),
        tuple(ms * bwd_scale for ms in costs.bwd_ms),
        costs.mem_bytes,
        costs.names,
    )


def measured_link_gbps(trace: Trace, since_iteration: int = 1) -> float | None:
    """The host link's bandwidth in GB/s as the weight uploads of iterations >= ``since_iteration``
    ran in ``trace`` (their bytes over their time on the upload lane); None when none ran."""
    moved, ms = 0, 0.0
    for task in trace:
        if task.kind == "param_up" and task.iteration >= since_iteration and task.end_t > task.start_t:
            moved += task.nbytes
            ms += task.end_t - task.start_t
    return moved / (ms * 1e6) if moved and ms > 0 else None


def with_link(
    device_plan: DevicePlan, config: RunConfig, trace: Trace, param_bytes: tuple[int, ...]
) -> DevicePlan:
    """``device_plan``, or the plan made on link-aware costs where that one runs faster with the
    measured link (`roundpipe.planning.link_plan.choose_link_plan`), with the link's report; unchanged
    when no upload was timed. Its costs stay the compute times."""
    from roundpipe.planning.link_plan import choose_link_plan

    gbps = measured_link_gbps(trace)
    if gbps is None or len(param_bytes) != device_plan.costs.num_layers:
        return device_plan
    made: dict[str, DevicePlan] = {}

    def make(costs: LayerCosts) -> Plan:
        if costs is device_plan.costs:
            return device_plan.plan
        args = (device_plan.memory, device_plan.plan.num_devices, device_plan.budget_bytes, device_plan.kind)
        made["aware"] = plan_from(config, costs, *args)
        return made["aware"].plan

    choice = choose_link_plan(
        make,
        device_plan.costs,
        param_bytes,
        gbps,
        device_plan.plan.num_devices,
        config.num_microbatches,
        async_optimizer=config.async_optimizer,
        round_size=config.round_size,
    )
    chosen = device_plan
    if choice.plan != device_plan.plan:
        chosen = replace(made["aware"], costs=device_plan.costs)
    # Only where uploads outlast compute: the fake engine there moves weights, not activations.
    if choice.report.link_bound_layers:
        chosen = with_prefetch(chosen, config, gbps, param_bytes, choice.iteration_ms)
    return replace(chosen, link=choice.report)


MAX_PREFETCH_STAGES = 3
"""The most stages a device uploads ahead (`ScheduleOptions.prefetch_stages`)."""
PREFETCH_GAIN = 0.005
"""The share of the iteration one more stage ahead must save, on the fake engine with the link
on, to be taken: it holds one more stage's parameters on the device."""


def with_prefetch(
    device_plan: DevicePlan,
    config: RunConfig,
    link_gbps: float,
    param_bytes: tuple[int, ...],
    iteration_ms: float,
) -> DevicePlan:
    """``device_plan`` with its parameters uploaded more stages ahead where that is faster.

    Why: with one stage ahead, an upload overlaps only the stage before it. In a run whose
    forward stages are link-bound and whose backward stages are compute-bound (GPT-OSS-20B at
    4 x 4096 tokens) the link idles while a backward stage finishes; uploading further ahead lets
    it go on with the next stages, the next iteration's forward ones included. Each further
    stage is taken while the predicted peak with it fits the budget and the fake engine, on this
    plan's costs, bytes and link (``iteration_ms``: its time one stage ahead), runs at least
    `PREFETCH_GAIN` faster; the prediction that counts it says how many (``prefetch``). Without
    a budget the run keeps one: more would take memory the user did not offer."""
    from roundpipe.plan.memory import in_flight_microbatches, predict_peak
    from roundpipe.planning.link_plan import link_iteration_ms

    if device_plan.budget_bytes is None:
        return device_plan
    plan, budget = device_plan.plan, planning_budget(device_plan.budget_bytes, device_plan.kind)
    best, best_ms = device_plan, iteration_ms
    for depth in range(device_plan.prediction.prefetch + 1, MAX_PREFETCH_STAGES + 1):
        prediction = predict_peak(
            plan,
            device_plan.memory,
            config.recompute_grain,
            prefetch=depth,
            act_in_flight=in_flight_microbatches(config.num_microbatches),
            num_devices=plan.num_devices,
            inputs_ahead=device_plan.prediction.inputs_ahead,
        )
        if not prediction.fits(budget):
            break
        ms = link_iteration_ms(
            plan,
            device_plan.costs,
            param_bytes,
            link_gbps,
            config.num_microbatches,
            async_optimizer=config.async_optimizer,
            round_size=config.round_size,
            prefetch_stages=depth,
        )
        if ms > best_ms * (1 - PREFETCH_GAIN):
            break
        best, best_ms = replace(device_plan, prediction=prediction), ms
    return best
