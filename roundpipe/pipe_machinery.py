"""The machinery under the `RoundPipe` facade: driving iterations and steps on the engine
thread, applying a new plan, and recovery after a failed task.

Why a module of its own: `roundpipe.pipe` is the public API and should read as one; what runs
on the loop thread to carry each call out lives here, as the facade's base class, so it shares
the facade's state without a second object to keep in step. The coroutines run on the engine's
loop thread (`roundpipe.loop_thread`); the facade's methods carry them there. It must never do
tensor math itself (that is the runtime's) nor decide ordering (the rules'), and never be used
but through `RoundPipe`, which builds every attribute declared here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from roundpipe.batch import microbatches
from roundpipe.config import RunConfig
from roundpipe.errors import (
    DeviceOutOfMemoryError,
    InputError,
    PipeClosedError,
    PlanError,
    ScheduleError,
    TaskFailedError,
    UsageError,
)
from roundpipe.loop_thread import LoopRunner
from roundpipe.model.chunked_mlp import SLICING_LEVELS, long_rows
from roundpipe.model.sequence import LayerSequence
from roundpipe.optim.host import HostModel, LossScaler
from roundpipe.pending import LossLedger, PendingLoss
from roundpipe.plan import LayerCosts, Plan
from roundpipe.plan.memory import saved_inputs, saved_residuals
from roundpipe.plan.rounds import round_sizes
from roundpipe.plan_meta import record_device_plan
from roundpipe.planning.device_plan import DevicePlan
from roundpipe.planning.host_activations import check_activation_room
from roundpipe.planning.replan import Replan, RunPlanner
from roundpipe.retention import Retention
from roundpipe.sched.engine import Engine
from roundpipe.sched.graph import GraphBuilder, ModelSpec
from roundpipe.sched.spec import ScheduleOptions
from roundpipe.sched.trace import Trace

if TYPE_CHECKING:
    from torch import nn

    from roundpipe.backends.runtime import Runtime


class PipeMachinery:
    """Counters, graph building, submission, loss collection, re-planning and recovery of one run.

    The attributes are set by `RoundPipe.__init__`."""

    config: RunConfig
    num_devices: int
    host: HostModel
    runtime: Runtime
    costs: LayerCosts
    plan: Plan
    _planner: RunPlanner
    _sequence: LayerSequence
    _model: nn.Module
    _scaler: LossScaler | None
    _spec: ModelSpec
    _options: ScheduleOptions
    _step_waits_for_loss: bool
    _iteration: int
    _stepped_at: int  # the iteration count at the last step(): a step needs new gradients
    _step: int
    _builder: GraphBuilder
    _retention: Retention
    _closed: bool
    _broken: str | None
    _runner: LoopRunner
    _trace: Trace
    _engine: Engine
    _losses: LossLedger

    def _new_builder(self, *, base_version: int, fresh_base_version: int | None = None) -> GraphBuilder:
        """A graph builder that continues this run's numbering from a compute copy that holds
        weight version ``base_version`` (``fresh_base_version`` for the fresh units, if other)."""
        return GraphBuilder(
            self.plan,
            self._spec,
            self.num_devices,
            self._options,
            first_iteration=self._iteration,
            first_step=self._step,
            base_version=base_version,
            fresh_base_version=fresh_base_version,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise PipeClosedError("this RoundPipe is closed; create a new one")
        if self._broken is not None:
            raise PipeClosedError(
                f"this RoundPipe stopped after an error it cannot recover from ({self._broken}); "
                "save what you need with state_dict() and create a new one"
            )

    async def _forward_backward(self, inputs: Any, targets: Any, loss_fn: Callable[..., Any] | None) -> float:
        """Submit and collect in one trip to the loop thread (``wait=True``)."""
        return await self._collect(await self._submit_iteration(inputs, targets, loss_fn))

    async def _submit_iteration(
        self, inputs: Any, targets: Any, loss_fn: Callable[..., Any] | None
    ) -> PendingLoss:
        """Build and submit one iteration's graph; its loss is collected later (`_collect`)."""
        from roundpipe.backends.runtime import IterationData

        if loss_fn is None and not self._sequence.computes_loss:
            raise InputError(
                "loss_fn is required for this model (its last layer does not compute a loss): "
                "pass forward_backward(inputs, targets, loss_fn) with loss_fn(output, target) -> scalar"
            )
        input_parts, target_parts, weights = microbatches(inputs, targets, self.config.num_microbatches)
        await self._losses.make_room(caller=self._iteration)
        if self._planner.claim_profile():  # claimed here, on the loop: one profile per run
            await asyncio.get_running_loop().run_in_executor(
                None, self._plan_on_device, input_parts[0], target_parts[0], loss_fn
            )
        iteration = self._iteration
        scale = self._scaler.scale if self._scaler is not None else 1.0
        grain, slots = self.runtime.recompute_grain, self.plan.slots
        saved = saved_inputs(slots, grain)  # kept for backward stages
        residuals = saved_residuals(slots, grain, self.runtime.save_residuals)
        self.runtime.begin_iteration(
            iteration,
            IterationData(input_parts, target_parts, weights, loss_fn, scale, saved, residuals=residuals),
        )
        graph = self._builder.forward_backward(iteration, self._step, self.config.num_microbatches)
        self._iteration += 1
        self._engine.submit(graph.tasks)
        self._retention.track(iteration, graph.done_keys)
        pending = PendingLoss(self, iteration, graph.loss_keys, weights)
        self._losses.add(pending)
        return pending

    async def _collect(self, pending: PendingLoss) -> float:
        """Wait for ``pending``'s loss (`LossLedger.collect`)."""
        return await self._losses.collect(pending)

    async def _optimizer_step(self) -> None:
        if self._iteration == self._stepped_at:
            raise UsageError(
                f"step() with no forward_backward since the last step (step {self._step}): there are "
                "no new gradients to apply; call forward_backward(...) first (several calls before one "
                "step() accumulate)"
            )
        if self._step_waits_for_loss and len(self._losses):  # see `RunPlanner.waits_for_loss`
            await self._losses.collect_all()
        self._stepped_at = self._iteration
        self.runtime.collectives.step_scheduled(self._step, self._iteration - 1)  # before its tasks run
        tasks = self._builder.optimizer_step(self._step)
        self._step += 1
        self._engine.submit(tasks)

    async def _synchronize(self) -> None:
        await self._losses.collect_all()
        try:
            await self._engine.wait()
        except (TaskFailedError, ScheduleError) as exc:
            self._recover(exc)
            raise
        await self._housekeeping()
        self.host.sync_module()

    async def _housekeeping(self) -> None:
        """Let go of what the retention policy no longer keeps; re-plan once from measured times
        (off the loop thread: planning times candidate plans on the fake engine)."""
        self._retention.tidy(self._engine, self.runtime, self._trace, self._iteration, self._step)
        if self._planner.replan_due(self._iteration):
            await asyncio.get_running_loop().run_in_executor(None, self._maybe_replan)

    def _plan_on_device(self, sample: Any, target: Any, loss_fn: Any) -> None:
        """Measure the layers on the first device with one microbatch; plan within the budget.

        Under a budget, long rows are measured and planned with the least slicing that fits
        (`chunked_mlp.SLICING_LEVELS`: whole, then per-token modules, then whole layers): slicing
        computes parts of a layer again in the backward, eagerly. A level fails by `PlanError` or
        by running out of memory while measured; a failure at the last level is the run's."""
        slicing = self.runtime.compiler.slicing
        long = self._planner.budget is not None and long_rows(sample)
        levels = SLICING_LEVELS if long else SLICING_LEVELS[-1:]
        plan: DevicePlan | None = None
        for level in levels:  # each measured outside the last one's handler (its traceback holds tensors)
            slicing.level = level
            try:
                plan = self._profile(sample, target, loss_fn)
                break
            except (PlanError, DeviceOutOfMemoryError):
                if level == levels[-1]:
                    raise
        assert plan is not None
        if long:
            self._trace.meta["long_row_slicing"] = slicing.level
        rounds = round_sizes(self.config.num_microbatches, self.num_devices, self._planner.config.round_size)
        # Before the first iteration, while the host holds no activation (a lower bound: one round).
        check_activation_room(
            plan.plan.slots, plan.memory, plan.grain, max(rounds), pinned=plan.kind == "cuda"
        )
        self._use_device_plan(plan)

    def _profile(self, sample: Any, target: Any, loss_fn: Any) -> DevicePlan:
        prepare = self.runtime.prepare_replica
        device = self.runtime.device(0)
        return self._planner.profile(
            self._sequence,
            self.host.dtype,
            device,
            sample,
            target,
            loss_fn,
            prepare=prepare,
            keep_residuals=self.runtime.save_residuals,  # what the run was assembled to save
        )

    def _use_device_plan(self, device_plan: DevicePlan) -> None:
        record_device_plan(device_plan, self.runtime, self._trace, self._builder.next_iteration)
        prediction = device_plan.prediction  # the uploads it counted are the ones to run
        counted = {
            "inputs_ahead": prediction.inputs_ahead,
            "prefetch_stages": prediction.prefetch,
            "flow_depth": prediction.act_in_flight,
            "layer_inputs": device_plan.grain == "layer_input",
            "layer_residuals": device_plan.residuals,
        }
        self.runtime.recompute_grain = device_plan.grain  # the grain the plan was made at
        self.runtime.save_residuals = device_plan.residuals
        self._trace.meta["recompute_grain"] = device_plan.grain
        self._trace.meta.setdefault("recompute_grain_why", device_plan.grain_why)  # the first plan chose
        changed = {k: v for k, v in counted.items() if getattr(self._options, k) != v}
        if changed:
            self._options = replace(self._options, **changed)  # type: ignore[arg-type]
            self._builder.options = self._options
            self._trace.meta.update(changed)
        if self._switch_plan(device_plan.plan, device_plan.costs):
            self._trace.meta["plan"] = device_plan.plan.to_dict()

    def _maybe_replan(self) -> None:
        """Re-plan once from measured times (`RunPlanner.replan`) and apply the new plan."""
        times = self.runtime.times.fwd_ms
        replan: Replan | None = self._planner.replan(self.costs, self._trace, times, self._spec.param_bytes)
        if replan is None:
            return
        if replan.device_plan is not None:
            self._use_device_plan(replan.device_plan)
        else:
            self._switch_plan(replan.plan, replan.costs)

    def _switch_plan(self, plan: Plan, costs: LayerCosts) -> bool:
        """Run the next iterations built under ``plan`` (made from ``costs``); whether it differs."""
        self.costs = costs
        changed = plan != self.plan
        if changed:
            self.plan = plan
            self._builder.set_plan(plan)
        self._step_waits_for_loss = self._planner.waits_for_loss(plan, costs)  # measured costs
        return changed

    def _recover(self, error: BaseException) -> None:
        """After a failed task: drop what cannot run, keep the host copies consistent, go on.

        The engine has let every task that did not depend on the failure finish, so each
        optimizer step is either fully applied or not at all. Gradients accumulated since the
        last step() are dropped; the compute copy is refreshed from the optimizer copy.
        """
        try:
            self._engine.cancel_pending()
        except ScheduleError:  # tasks still running (watchdog): nothing safe to do
            self._broken = str(error).splitlines()[0]
            return
        self.runtime.reset()
        self.host.drop_gradients()
        self.host.p_copy_all()
        self._retention.clear()
        self._builder = self._new_builder(base_version=self._step)
        self._losses.drop_all(error)  # submitted after the failure's iteration
