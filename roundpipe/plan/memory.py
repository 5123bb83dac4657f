"""Device memory per stage kind: what a plan will hold on a device, from per-layer facts.

A stage needs far more than its parameters: gradients, the activations autograd saves, working
memory, the prefetched next stage and activations in flight. `LayerMemory` holds the measured facts
per layer (bytes for ONE microbatch); `stage_bytes` turns them into a stage's peak for each kind
(see docs/memory.md and DESIGN.md "Memory is part of the plan"); `predict_peak` adds the
prefetched stage and boundary activations and reports the per-slot breakdown of a whole plan.

Two models, one conservative, one exact. The partitioner's search sums one number per layer and
checks every stage against one cap (``mem_limit_bytes // 2``: a stage and the one prefetched
behind it). `layer_plan_bytes` gives it per-layer numbers whose sum over any stage bounds the
stage's exact bytes for every kind (each max of the exact model is at most the sum of its
non-negative terms), and `partition_limit_bytes` the limit that leaves room for activations in
flight. The sums overestimate, so the exact prediction (`predict_peak`) is computed after
planning, reported, and judges: `plan_within_budget` lowers the limit and re-plans until it fits,
and otherwise fails naming the slot that does not fit.

Pure arithmetic over integers: never import torch, measure, or touch a device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, cast

from roundpipe.errors import PlanError
from roundpipe.plan.in_flight import boundary_in_flight, held_inputs
from roundpipe.plan.kinds import Grain
from roundpipe.plan.layer_memory import LayerMemory
from roundpipe.plan.sizes import format_bytes

StageKind = Literal["fwd", "fused", "bwd"]


def _check_stage(mem: LayerMemory, layers: range) -> None:
    if not isinstance(layers, range) or layers.step != 1 or len(layers) == 0:
        raise PlanError(f"a stage is a non-empty range of consecutive layers, got {layers!r}")
    if not 0 <= layers.start < layers.stop <= mem.num_layers:
        raise PlanError(f"stage {layers!r} is outside the {mem.num_layers} layers of this memory table")


def _io(mem: LayerMemory, layer: int) -> int:
    """A layer's input and output alive together (their carried constants are shared)."""
    shared = min(mem.carried_bytes[layer], mem.carried_bytes[layer + 1]) if layer + 1 < mem.num_layers else 0
    return mem.boundary_bytes[layer] + mem.output_bytes(layer) - shared


def _weights(mem: LayerMemory, layers: range) -> int:
    """A stage's parameters, the dense copies of its 4-bit ones and its gradients."""
    return sum(mem.param_bytes[j] + mem.dense_bytes[j] + mem.grad_bytes[j] for j in layers)


def _backprop_peak(mem: LayerMemory, layers: range) -> int:
    """Forward with grad then backward over ``layers``: the most saved + transient at any point.

    Recompute forward at layer j holds the saved bytes of the layers before it, its own (a working
    set is measured above what the forward keeps, and a layer may allocate what it keeps first:
    the LM head's loss allocates its weight gradient before the chunks of logits) and its working
    set; backward at layer j still holds the saved bytes up to j (deeper ones were freed), its
    working set, and from the second microbatch of a run on a fresh gradient of layer j's
    parameters that is being added into the accumulated one (measured on an LM head: 622 MB),
    unless the forward computed that gradient already (then it is among the saved bytes).
    """
    peak, before = 0, 0
    for j in layers:
        before += mem.saved_bytes[j]
        peak = max(peak, before + mem.work_bytes[j])
        fresh = mem.grad_bytes[j] - min(mem.grad_bytes[j], mem.saved_grad_bytes[j])
        peak = max(peak, before + mem.bwd_work_bytes[j] + fresh)
    return peak


def stage_bytes(mem: LayerMemory, layers: range, kind: StageKind, grain: Grain = "stage") -> int:
    """Peak device bytes of one stage for one microbatch, without prefetch or activations in flight.

    Parameters include the dense copies of 4-bit weights a run holds (``dense_bytes``).

    - ``fwd``: parameters + the largest (input + output + working set) of one layer;
    - ``fused``: parameters + gradients + every layer's saved activations (no recompute) + the
      working set (the LM head's loss is the last layer's);
    - ``bwd``: parameters + gradients + the recompute of the whole stage (``grain="stage"``), or
      of one layer at a time plus every layer's input kept for it (``grain="layer"``), or of the
      whole stage from every layer's uploaded input, each layer's output kept as a root beside it
      (``grain="layer_input"``).
    """
    _check_stage(mem, layers)
    params = sum(mem.param_bytes[i] + mem.dense_bytes[i] for i in layers)
    if kind == "fwd":
        return params + max(_io(mem, i) + mem.work_bytes[i] for i in layers)
    grads = sum(mem.grad_bytes[i] for i in layers)
    if kind == "fused" or (kind == "bwd" and grain == "stage"):
        return params + grads + _backprop_peak(mem, layers)
    if kind == "bwd" and grain == "layer_input":
        return params + grads + _backprop_peak(mem, layers) + held_inputs(mem, layers)
    if kind == "bwd" and grain == "layer":
        one = max(_backprop_peak(mem, range(i, i + 1)) for i in layers)
        return params + grads + held_inputs(mem, layers) + one
    raise PlanError(f"unknown stage kind {kind!r} or recompute grain {grain!r}")


@dataclass(frozen=True)
class SlotMemory:
    """One slot's predicted peak: its stage, the prefetched stages' parameters, activations in flight,
    and the device's previous fused or backward stage, whose weights and gradients stay until the
    gradients' download completes (while this stage's first microbatch already runs; when those
    gradients are small, its frozen weights go at its last compute: only the part that exceeds this
    stage's activations and the farthest prefetched stage's parameters, as it overlaps the stage's
    start, before that upload begins, not its peak), and, for a backward stage, its last
    recomputed microbatch, which may still await its gradient."""

    index: int
    kind: str
    layers: range
    stage_bytes: int
    prefetch_bytes: int
    in_flight_bytes: int
    draining_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.stage_bytes + self.prefetch_bytes + self.in_flight_bytes + self.draining_bytes

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)} | {"total_bytes": self.total_bytes}
        return d | {"layers": [self.layers.start, self.layers.stop]}


@dataclass(frozen=True)
class MemoryPrediction:
    """The predicted peak device memory of a plan: the largest slot total, and every slot's parts."""

    slots: tuple[SlotMemory, ...]
    grain: str
    # Whether a backward stage's next input is uploaded while the stage computes (`predict_peak`).
    inputs_ahead: bool = True
    prefetch: int = 1  # stages whose parameters are uploaded ahead (`ScheduleOptions.prefetch_stages`)
    act_in_flight: int = 2  # microbatches' boundary activations counted (`ScheduleOptions.flow_depth`)

    @property
    def peak_bytes(self) -> int:
        return max(s.total_bytes for s in self.slots)

    @property
    def peak_slot(self) -> SlotMemory:
        return max(self.slots, key=lambda s: s.total_bytes)

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.peak_bytes <= budget_bytes

    def describe(self, slot: int | None = None) -> str:  # the peak slot, or slot ``slot`` (an OOM's)
        s = self.peak_slot if slot is None else self.slots[slot]
        return (
            f"predicted peak {format_bytes(s.total_bytes)} in slot {s.index} ({s.kind}, layers "
            f"[{s.layers.start}, {s.layers.stop})): stage {format_bytes(s.stage_bytes)} + prefetch "
            f"{format_bytes(s.prefetch_bytes)} + activations in flight {format_bytes(s.in_flight_bytes)}"
            f" + previous stage draining {format_bytes(s.draining_bytes)}"
        )

    def to_dict(self) -> dict[str, Any]:
        head = {"peak_bytes": self.peak_bytes, "peak_slot": self.peak_slot.index, "grain": self.grain}
        head |= {
            "inputs_ahead": self.inputs_ahead,
            "prefetch": self.prefetch,
            "act_in_flight": self.act_in_flight,
            # A small-gradient stage's drain counted apart from the farthest prefetched stage
            # (`predict_peak`): records without it counted both, as `bench/recount_memory.py` says.
            "drain_apart": True,
        }
        return head | {"slots": [s.to_dict() for s in self.slots]}


SMALL_GRADIENTS_RATIO = 20
"""A stage whose gradients are at most 1/20 of its parameters (frozen base weights, adapters
trained) drains over the next stage's start only: its frozen weights go at its last compute
(`pop_frozen`), before the next run's first recompute (`sched/backward_run.py`), and its adapters'
gradients download at once (the 14B LoRA C); a fully trained stage's stay for their download."""


def saved_inputs(slots: Sequence[Any], grain: Grain) -> frozenset[int]:
    """Layers whose input forward stages save: non-forward stage starts (layer_input: all bwd layers)."""
    held = frozenset(s.layers.start for s in slots if s.kind != "fwd")
    if grain == "layer_input":
        held |= frozenset(j for s in slots if s.kind == "bwd" for j in s.layers)
    return held


def saved_residuals(slots: Sequence[Any], grain: Grain, on: bool) -> frozenset[int]:
    """Layers whose post-attention residual forward stages save beside their input (``on``: the
    run saves residuals; only under layer_input, for every bwd layer)."""
    if not on or grain != "layer_input":
        return frozenset()
    return frozenset(j for s in slots if s.kind == "bwd" for j in s.layers)


def input_sender(fwd_stages: Sequence[range], layer: int) -> int | None:
    """The forward stage whose downloads carry ``layer``'s input (> 0): the one ending there or
    holding it inside; None past every forward stage."""
    return next((i for i, r in enumerate(fwd_stages) if r.start < layer <= r.stop), None)


def residual_sender(fwd_stages: Sequence[range], layer: int) -> int | None:
    """The forward stage that computes ``layer``, so sends its residual down; None past them."""
    return next((i for i, r in enumerate(fwd_stages) if r.start <= layer < r.stop), None)


def _draining(
    mem: LayerMemory, slot: Any, before: Any, own: int, farthest: int, grain: Grain, num_devices: int
) -> int:
    """What the device's previous run (``before``) still holds while ``slot``'s run (``own``
    bytes of stage) starts, beside the ``farthest`` stage uploaded ahead (see `SlotMemory`)."""
    draining = 0
    if before.kind != "fwd":
        before_params = sum(mem.param_bytes[j] for j in before.layers)
        before_grads = sum(mem.grad_bytes[j] for j in before.layers)
        draining = before_params + before_grads
        if before_grads * SMALL_GRADIENTS_RATIO <= before_params:
            # Adapters only: its download ends before this stage has built its activations,
            # so the drain only overlaps this stage's start (its weights and gradients), and
            # the farthest stage ahead uploads only once the previous stage's last compute is
            # done (`sched/graph.py`: a run's uploads wait for the run prefetch + 1 before).
            weights = _weights(mem, slot.layers)
            draining = max(0, draining - (own - weights) - farthest)
    # Its last recompute may still await its gradient, except on one device, where this
    # stage's first recompute waits for that backward (`sched/backward_run.py`).
    if before.kind == "bwd" and num_devices > 1:
        recomputed = sum(mem.saved_bytes[j] for j in before.layers) if grain != "layer" else 0
        draining += recomputed + (held_inputs(mem, before.layers) if grain != "stage" else 0)
    return draining


def predict_peak(
    plan: Sequence[Any] | Any,
    mem: LayerMemory,
    grain: Grain = "stage",
    prefetch: int = 1,
    act_in_flight: int = 2,
    num_devices: int = 1,
    inputs_ahead: bool = True,
) -> MemoryPrediction:
    """The peak device bytes of ``plan`` (a `Plan` or its ``slots``) on the device running each slot.
    Per slot: `stage_bytes` + the parameters of the ``prefetch`` stages that device runs next
    (round-robin: slot ``i + k * num_devices``, cyclically, since the next round and the next
    iteration continue the same sequence) + boundary activations in flight, the next run's first
    inputs among them (`roundpipe.plan.in_flight`)."""
    slots: Sequence[Any] = tuple(getattr(plan, "slots", plan))
    if not slots:
        raise PlanError("a plan needs at least one slot")
    covered = max(s.layers.stop for s in slots)
    if covered != mem.num_layers:
        raise PlanError(f"the plan covers {covered} layers but the memory table {mem.num_layers}")
    held = saved_inputs(slots, grain)
    params = [sum(mem.param_bytes[i] for i in s.layers) for s in slots]
    out = []
    for i, slot in enumerate(slots):
        # The same slot may come back (one slot, or as many devices as slots): another run, another copy.
        ahead = [(i + k * num_devices) % len(slots) for k in range(1, prefetch + 1)]
        following = slots[(i + num_devices) % len(slots)]  # the device's next run, unless it is this one
        next_run = None if following is slot else following
        in_flight = boundary_in_flight(
            mem, slot, next_run, held, act_in_flight, inputs_ahead, grain, num_devices
        )
        before = slots[(i - num_devices) % len(slots)]
        own = stage_bytes(mem, slot.layers, slot.kind, grain)  # type: ignore[arg-type]
        farthest = params[ahead[-1]] if ahead else 0
        draining = _draining(mem, slot, before, own, farthest, grain, num_devices)
        out.append(
            SlotMemory(
                i,
                slot.kind,
                slot.layers,
                own,
                sum(params[j] for j in ahead),
                in_flight,
                draining,
            )
        )
    return MemoryPrediction(tuple(out), grain, inputs_ahead, prefetch, act_in_flight)


def predict_like(
    held: MemoryPrediction, plan: Any, mem: LayerMemory, *, prefetch: int | None = None
) -> MemoryPrediction:
    """`predict_peak` of ``plan`` (a `Plan`) counted as ``held`` was: its grain, inputs ahead,
    activations in flight and, unless ``prefetch`` is given, stages uploaded ahead."""
    return predict_peak(
        plan,
        mem,
        cast(Grain, held.grain),
        prefetch=held.prefetch if prefetch is None else prefetch,
        act_in_flight=held.act_in_flight,
        num_devices=plan.num_devices,
        inputs_ahead=held.inputs_ahead,
    )


# ---------------------------------------------------------------------- the partitioner's view


def layer_plan_bytes(mem: LayerMemory, grain: Grain = "stage", act_in_flight: int = 2) -> tuple[int, ...]:
    """One number per layer whose sum over any stage, plus the carried constants once, bounds
    `stage_bytes` of every kind and grain and a forward stage's held activations.

    Per layer: parameters (and dense copies) + gradients + saved + the larger working set + its own
    input (without the carried constants; with its saved residual) ``act_in_flight + 1`` times (a forward stage holds it for a backward
    stage starting there, for the computing microbatch and those in flight; layer and layer_input
    grain keep it, and layer_input uploads it ahead). The constants are one storage:
    `partition_limit_bytes` sets them aside once.
    """
    del grain  # every grain is bounded by the same sum; kept so callers state what they plan
    out = []
    for i in range(mem.num_layers):
        work = max(mem.work_bytes[i] + mem.output_bytes(i), mem.bwd_work_bytes[i] + mem.grad_bytes[i])
        own_input = (mem.boundary_bytes[i] - mem.carried_bytes[i] + mem.residual_bytes[i]) * (
            act_in_flight + 1
        )
        weights = mem.param_bytes[i] + mem.dense_bytes[i] + mem.grad_bytes[i]
        out.append(weights + mem.saved_bytes[i] + work + own_input)
    return tuple(out)


def in_flight_reserve(mem: LayerMemory, act_in_flight: int = 2) -> int:
    """An upper bound of the stage inputs and outputs of ``act_in_flight`` microbatches on any
    slot, set aside before the partitioner sees the budget."""
    return act_in_flight * 2 * max(mem.boundary_bytes)


def partition_limit_bytes(mem: LayerMemory, budget_bytes: int, act_in_flight: int = 2) -> int:
    """The ``mem_limit_bytes`` to give the partitioner, with costs' ``mem_bytes`` set to
    `layer_plan_bytes`: the budget less `in_flight_reserve` and the carried constants of both
    halves. The partitioner halves it (a stage and the stage prefetched behind it), so every
    stage's per-layer sum stays under `per_layer_cap`, and its exact bytes under half the rest."""
    reserve = in_flight_reserve(mem, act_in_flight) + 2 * max(mem.carried_bytes)
    limit = budget_bytes - reserve
    if limit < 2:
        raise PlanError(
            f"the memory budget {format_bytes(budget_bytes)} does not even hold the activations in flight "
            f"({format_bytes(reserve)}: {act_in_flight} microbatches' stage inputs and outputs and the "
            "carried constants); use more microbatches (fewer tokens each) or a larger budget"
        )
    return limit


def per_layer_cap(mem: LayerMemory, budget_bytes: int, act_in_flight: int = 2) -> int:
    """The cap each stage's sum of `layer_plan_bytes` must stay under for ``budget_bytes``."""
    return partition_limit_bytes(mem, budget_bytes, act_in_flight) // 2


def plan_within_budget(
    make_plan: Callable[[int], Any],
    mem: LayerMemory,
    budget_bytes: int,
    grain: Grain = "stage",
    *,
    num_devices: int = 1,
    act_in_flight: int = 2,
    attempts: int = 8,
    inputs_ahead: bool = True,
) -> tuple[Any, MemoryPrediction]:
    """Plan with an optimistic limit, then let the exact model judge: while the predicted peak
    exceeds the budget, lower the limit by the overshoot and plan again.

    The first limit assumes the stage prefetched behind a stage is no larger than the largest
    layer's parameters (the partitioner's own rule, half the limit each, would refuse an LM head
    whose gradients and logits take more than half a 4 GiB budget although it fits beside the
    small stage that follows it); it is never below `partition_limit_bytes`.

    ``make_plan(limit)`` returns a plan (anything with ``slots``) for ``mem_limit_bytes=limit`` and
    raises `PlanError` when none fits. Returns the plan and its prediction.
    """
    halved = partition_limit_bytes(mem, budget_bytes, act_in_flight)
    reserve = in_flight_reserve(mem, act_in_flight) + 2 * max(mem.carried_bytes) + max(mem.param_bytes)
    first = limit = max(halved, 2 * (budget_bytes - reserve))
    for _ in range(attempts):
        try:
            plan = make_plan(limit)
        except PlanError as exc:
            if limit != first:
                break  # smaller limits cannot split the layers further: report the last plan
            budget = format_bytes(budget_bytes)
            raise PlanError(
                f"memory budget {budget} (at most {format_bytes(limit // 2)} per stage): {exc}"
            ) from exc
        prediction = predict_peak(
            plan, mem, grain, act_in_flight=act_in_flight, num_devices=num_devices, inputs_ahead=inputs_ahead
        )
        if prediction.fits(budget_bytes):
            return plan, prediction
        over = prediction.peak_bytes - budget_bytes
        limit = min(limit - 2 * over, limit * 7 // 8)  # the overshoot, counted in both halves
        if limit < 2:
            break
    raise PlanError(
        f"no plan fits the memory budget {format_bytes(budget_bytes)}: the best one has a "
        f"{prediction.describe()}. Use more microbatches (fewer tokens each), recompute_grain='layer', "
        "a shorter sequence, or a larger memory_budget"
    )
