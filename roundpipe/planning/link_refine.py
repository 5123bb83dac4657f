"""A device plan refined once the host link is measured: link-aware costs, even stages, and how
many stages a device uploads ahead.

Why apart from the plan it refines: the stages are first cut from the profile's compute times
(`roundpipe.planning.device_plan`); the link's rate is known only from the first iterations'
uploads (`measured_link_gbps`), and only then whether uploads outlast compute, whether an even cut
hides them better, and whether the link idles while a backward stage finishes.

This module must never touch a device.
"""

from __future__ import annotations

from dataclasses import replace

from roundpipe.config import RunConfig
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning import device_plan as device_plans
from roundpipe.planning.device_plan import DevicePlan, plan_from, planning_budget
from roundpipe.planning.measured import measured_link_gbps
from roundpipe.sched.trace import Trace


def with_link(
    device_plan: DevicePlan, config: RunConfig, trace: Trace, param_bytes: tuple[int, ...]
) -> DevicePlan:
    """``device_plan``, or the plan made on link-aware costs where that one runs faster with the
    measured link (`roundpipe.planning.link_plan.choose_link_plan`), one device's coarse stages
    cut evenly where that runs faster (`roundpipe.planning.even_stages`), with the link's report;
    unchanged when no upload was timed. Its costs stay the compute times."""
    from roundpipe.planning.even_stages import even_cut
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
    iteration_ms = choice.iteration_ms
    # The remainder stages' exposed uploads (`even_stages`); the setting is read where it lives.
    if device_plans.STAGES_ON_ONE_DEVICE != "balanced":
        budget = None if chosen.budget_bytes is None else planning_budget(chosen.budget_bytes, chosen.kind)
        even = even_cut(chosen, budget, config, (gbps, param_bytes), iteration_ms)
        if even is not None:
            chosen, iteration_ms = (
                replace(chosen, plan=even.plan, prediction=even.prediction, memory=even.memory),
                even.iteration_ms,
            )
    # Only where uploads outlast compute: the fake engine there moves weights, not activations.
    if choice.report.link_bound_layers:
        chosen = with_prefetch(chosen, config, gbps, param_bytes, iteration_ms)
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
    from roundpipe.plan.memory import predict_like
    from roundpipe.planning.link_plan import link_iteration_ms

    if device_plan.budget_bytes is None:
        return device_plan
    plan, budget = device_plan.plan, planning_budget(device_plan.budget_bytes, device_plan.kind)
    best, best_ms = device_plan, iteration_ms
    for depth in range(device_plan.prediction.prefetch + 1, MAX_PREFETCH_STAGES + 1):
        prediction = predict_like(device_plan.prediction, plan, device_plan.memory, prefetch=depth)
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
