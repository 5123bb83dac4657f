"""What a running pipe records about a plan made on its devices, and where.

A plan measured on the device (`roundpipe.planning.device_plan.DevicePlan`) carries more than the
plan: its memory prediction, the budget and the measured layer costs and host link. The runtime
needs the prediction to explain an out-of-memory error in terms of the plan an iteration was
built for, and the trace carries all of it so that a trace file says what the planner saw. This
module writes those records in one place. It must never choose or apply a plan (the planner
chooses, the facade applies), and never change what an already built iteration runs under.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roundpipe.planning.dequantize import dense_weights_of, per_call_layers_of

if TYPE_CHECKING:
    from roundpipe.backends.runtime import Runtime
    from roundpipe.planning.device_plan import DevicePlan
    from roundpipe.sched.trace import Trace


def record_device_plan(device_plan: DevicePlan, runtime: Runtime, trace: Trace, next_iteration: int) -> None:
    """Record ``device_plan``'s prediction for the iterations from ``next_iteration`` on (those
    built earlier keep the prediction of the plan they were built for) and its measurements in the
    trace's metadata: the first profiled layer costs stay, later refined ones replace the current."""
    runtime.memory_prediction = device_plan.prediction
    # A re-plan keeps the first plan's memory table, so every plan of a run dequantizes alike, but
    # for the fused stage its even cut may leave per call (`roundpipe.planning.even_stages`).
    runtime.dense.enabled = dense_weights_of(device_plan.memory)
    runtime.dense.per_call = per_call_layers_of(device_plan.memory)
    trace.meta["dense_weights"] = runtime.dense.enabled
    trace.meta["dense_per_call_layers"] = runtime.dense.per_call_layers()
    runtime.memory_predictions[next_iteration] = device_plan.prediction
    trace.meta["memory_prediction"] = device_plan.prediction.to_dict()
    trace.meta["memory_budget_bytes"] = device_plan.budget_bytes
    trace.meta.setdefault("profiled_layer_costs", device_plan.costs.to_dict())
    trace.meta["layer_costs"] = device_plan.costs.to_dict()
    if device_plan.link is not None:
        trace.meta["link"] = device_plan.link.to_dict() | {"summary": device_plan.link.describe()}
