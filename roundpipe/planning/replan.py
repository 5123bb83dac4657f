"""The plan a run executes over its life: from estimated costs at construction, then from the
layers measured on the device, then once more from measured times.

Why apart from the facade: which plan runs is a question of costs, the memory budget and the
evaluated iteration, all of which live in this package; `RoundPipe` only has to apply the answer
(the graph builder, the runtime's memory prediction, the trace's metadata). `RunPlanner` holds
what the answers depend on (the planning config, the budget, the plan measured on the device,
whether the one re-plan has happened) and returns plans.

It must never touch the engine, the runtime or the trace's metadata itself, and never re-plan
more than once: a run's numerics do not depend on its plan, but its timings should settle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roundpipe.config import RunConfig
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.device_plan import (
    DevicePlan,
    plan_from,
    planning_config,
    profile_and_plan,
    resolve_budget,
)
from roundpipe.planning.link_refine import with_link
from roundpipe.planning.measured import REPLAN_AFTER_ITERATIONS, refined_costs
from roundpipe.planning.ranking import choose_evaluated_plan, submission_lag

if TYPE_CHECKING:
    import torch

    from roundpipe.sched.trace import Trace


def plan_for(costs: LayerCosts, config: RunConfig, num_devices: int) -> Plan:
    """The plan for ``costs``; a planning failure says what to change in the `RunConfig`."""
    try:
        return choose_evaluated_plan(
            costs,
            num_devices,
            config.num_microbatches,
            config.mem_limit_bytes,
            async_optimizer=config.async_optimizer,
            round_size=config.round_size,
            loss_lag=config.loss_lag,
        )
    except PlanError as exc:
        raise PlanError(
            f"{exc}\n(RoundPipe counts a layer's memory as its parameter bytes in the compute "
            f"precision {config.precision!r}: raise RunConfig.mem_limit_bytes "
            f"(now {config.mem_limit_bytes}) or use precision='bf16')"
        ) from None


def measured_costs(fwd_ms: Sequence[float | None], previous: LayerCosts) -> LayerCosts | None:
    """Costs from measured forward times (backward twice the forward), or None while some layer
    has not been measured yet."""
    if any(ms is None for ms in fwd_ms):
        return None
    fwd = tuple(float(ms) for ms in fwd_ms if ms is not None)
    return LayerCosts(fwd, tuple(2 * f for f in fwd), previous.mem_bytes, previous.names)


@dataclass(frozen=True)
class Replan:
    """A re-plan's outcome: the costs it planned from, the plan, and the device plan (memory
    prediction and budget) where the layers were measured on the device."""

    costs: LayerCosts
    plan: Plan
    device_plan: DevicePlan | None = None


class RunPlanner:
    """Chooses the plan of one run. Built before anything is allocated on a device: resolving
    the budget enforces it where it is below the card."""

    def __init__(self, config: RunConfig, kind: str, indices: tuple[int, ...], num_devices: int) -> None:
        self.budget = resolve_budget(config, kind, indices)
        self.config = planning_config(config, kind)
        self.num_devices = num_devices
        self.replan_enabled = config.replan
        # On CUDA, or under a user budget, the first iteration measures the layers and plans anew.
        self.profile_pending = kind == "cuda" or config.memory_budget is not None
        self.device_plan: DevicePlan | None = None
        self.replanned = False

    def claim_profile(self) -> bool:
        """Whether the layers are still to be measured on the device; True once only."""
        pending, self.profile_pending = self.profile_pending, False
        return pending

    def first_plan(self, costs: LayerCosts) -> Plan:
        return plan_for(costs, self.config, self.num_devices)

    def profile(
        self,
        sequence: Any,
        dtype: torch.dtype,
        device: torch.device,
        sample: Any,
        target: Any,
        loss_fn: Any,
        *,
        prepare: Any = None,
        keep_residuals: bool,
    ) -> DevicePlan:
        """Measure the layers on ``device`` with one microbatch (keeping residuals where the run
        may save them: `roundpipe.planning.device_plan.may_save_residuals`); plan within the budget."""
        self.profile_pending = False  # also when called without `claim_profile`
        self.device_plan = profile_and_plan(
            self.config,
            sequence,
            dtype,
            device,
            self.num_devices,
            sample,
            target,
            loss_fn,
            self.budget,
            prepare=prepare,
            keep_residuals=keep_residuals,
        )
        # A re-plan keeps the grain this plan chose ("auto" chooses once, here).
        self.config = self.config.model_copy(update={"recompute_grain": self.device_plan.grain})
        return self.device_plan

    def replan_due(self, iteration: int) -> bool:
        """Whether the one re-plan from measured times should run after ``iteration`` iterations
        (measured on the device: the first iteration compiles, so from the second)."""
        after = 1 if self.device_plan is None else REPLAN_AFTER_ITERATIONS
        return self.replan_enabled and not self.replanned and iteration >= after

    def replan(
        self,
        costs: LayerCosts,
        trace: Trace,
        fwd_ms: Sequence[float | None],
        param_bytes: tuple[int, ...],
    ) -> Replan | None:
        """The plan from measured times, or None while they are incomplete (tried again later)."""
        old = self.device_plan
        if old is not None:  # measured on the device: refine from its timings
            refined = refined_costs(trace, costs)
            if refined is None:
                return None
            self.replanned = True
            # Its kind: on CUDA the re-plan keeps the allocator's headroom too.
            device_plan = plan_from(
                self.config, refined, old.memory, self.num_devices, old.budget_bytes, old.kind
            )
            if old.kind == "cuda":  # uploads that outlast compute (experts) reshape the plan
                device_plan = with_link(device_plan, self.config, trace, param_bytes)
            self.device_plan = device_plan
            return Replan(device_plan.costs, device_plan.plan, device_plan)
        measured = measured_costs(fwd_ms, costs)
        if measured is None:
            return None
        self.replanned = True
        return Replan(measured, plan_for(measured, self.config, self.num_devices))

    def waits_for_loss(self, plan: Plan, costs: LayerCosts) -> bool:
        """With `RunConfig.loss_lag` 1: whether ``plan`` runs faster when each step waits for its
        iteration's losses, so that the next iteration goes in only then, as in a loop that reads
        every loss at once (`roundpipe.planning.ranking.submission_lag`: the fake engine on the
        plan's costs). The loop still gets its `PendingLoss` at once; only ``step()`` waits."""
        config = self.config
        if not config.loss_lag or not config.async_optimizer:
            return False
        lag = submission_lag(
            plan,
            costs,
            self.num_devices,
            config.num_microbatches,
            async_optimizer=True,
            round_size=config.round_size,
            loss_lag=config.loss_lag,
        )
        return lag == 0
