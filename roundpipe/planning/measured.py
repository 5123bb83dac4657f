"""What the device's own timing of a run says to the planner: refined layer costs, the link's rate.

Why apart from `roundpipe.planning.device_plan`: a plan is first made from a profile, one layer at
a time on one microbatch; after a few iterations the trace holds the device's timing of every
task of the plan as it runs, and the re-plan (`roundpipe.planning.replan`) reads it here. These
functions only read a trace's public fields; they never plan and never touch a device.
"""

from __future__ import annotations

import itertools
import statistics

from roundpipe.plan import LayerCosts
from roundpipe.sched.trace import Trace

REPLAN_AFTER_ITERATIONS = 2
"""A plan made from measured layers is re-planned once this many iterations have run: the first
compiles and warms up, so the timings come from the second (`refined_costs`)."""


def refined_costs(trace: Trace, costs: LayerCosts, since_iteration: int = 1) -> LayerCosts | None:
    """Costs scaled so that each stage kind's compute tasks of iterations >= ``since_iteration``,
    as the device timed them in ``trace``, match what the costs predict for them; None when
    nothing was timed. The first iteration never counts: it compiles each layer kind's graphs and
    warms the allocator (on an H200, A's first-iteration forward tasks took 9x their steady time
    and its backward tasks 2x, and a re-plan from them took forward stages for ten times dearer
    than they are). Each task counts at the median time of the tasks that ran the same work (its
    task kind, stage kind and layers, over microbatches and iterations): a graph compiled late
    (a variant a later iteration first needs) is one task of seconds among many of milliseconds,
    and in a sum it would make every layer dearer."""
    durations: dict[tuple[str, str, range], list[float]] = {}
    for task in trace:
        if task.kind not in ("compute", "recompute") or task.end_t < task.start_t or not len(task.layers):
            continue
        if task.iteration < since_iteration:
            continue
        work = (task.kind, str(task.stage_kind), task.layers)
        durations.setdefault(work, []).append(task.end_t - task.start_t)
    measured: dict[str, float] = {}
    predicted: dict[str, float] = {}
    for (task_kind, kind, layers), times in durations.items():
        if kind == "fwd":
            model = costs.fwd_stage_ms(layers)
        elif kind == "fused":
            model = costs.fused_stage_ms(layers)
        elif task_kind == "recompute":  # a backward stage's two tasks share its forward + backward
            model = costs.fwd_stage_ms(layers)
        else:
            model = costs.bwd_stage_ms(layers) - costs.fwd_stage_ms(layers)
        measured[kind] = measured.get(kind, 0.0) + statistics.median(times) * len(times)
        predicted[kind] = predicted.get(kind, 0.0) + model * len(times)
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
    ran in ``trace``: the rate of their bytes' median, each upload at its own rate (bytes over its
    time on the upload lane; half of the bytes moved at least that fast); None when none ran.

    Why a median: an upload's span runs from its start event to its last copy's end, and what the
    host does between the two lands in it (waiting on the interpreter lock while a layer variant
    compiles, or on the caching allocator growing its pool). Summed over iterations >= 1, the
    spans of E (Qwen3-32B on an H100) read its link at 24.5 GB/s, where the uploads of its steady
    iterations took 2,335 ms for 122.8 GB (52.6): a few long spans carried most of the time. They
    move the median by nothing."""
    rates = sorted(
        (task.nbytes / ((task.end_t - task.start_t) * 1e6), int(task.nbytes))
        for task in trace
        if task.kind == "param_up"
        and task.iteration >= since_iteration
        and task.end_t > task.start_t
        and task.nbytes > 0
    )
    if not rates:
        return None
    half = sum(nbytes for _, nbytes in rates) / 2
    moved = itertools.accumulate(nbytes for _, nbytes in rates)
    return next(rate for (rate, _), total in zip(rates, moved, strict=True) if total >= half)
