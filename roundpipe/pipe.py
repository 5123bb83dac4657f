"""`RoundPipe`: the facade users call. Thin: it wires model, host copies, plan, graph builder,
engine and backend together and translates the public API into submitted task graphs.

What it delegates: the engine's loop thread (`roundpipe.loop_thread`), which plan runs and when it
is re-planned (`roundpipe.planning.replan`), what is kept how long (`roundpipe.retention`), and the
state format (`roundpipe.state`). What it keeps: the counters of iterations and steps, applying a
new plan, and recovery after a failed task.
It must never do tensor math itself (that is the runtime's) nor decide ordering (the rules').
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload

from torch import nn

from roundpipe.assembly import (
    estimated_costs,
    make_backend,
    make_host,
    make_runtime,
    make_scaler,
    schedule_options,
)
from roundpipe.batch import microbatches
from roundpipe.config import RunConfig
from roundpipe.errors import (
    ConfigError,
    InputError,
    PipeClosedError,
    ScheduleError,
    TaskFailedError,
    UsageError,
    name_earlier_iteration,
)
from roundpipe.loop_thread import LoopRunner, shutdown
from roundpipe.model.quant import apply_base_format
from roundpipe.model.sequence import to_layer_sequence
from roundpipe.optim.host import OptimizerFactory, SchedulerFactory
from roundpipe.plan import Plan
from roundpipe.plan.memory import MemoryPrediction
from roundpipe.planning.device_plan import DevicePlan, budget_release
from roundpipe.planning.replan import Replan, RunPlanner
from roundpipe.retention import Retention
from roundpipe.sched.engine import Engine
from roundpipe.sched.graph import GraphBuilder, ModelSpec
from roundpipe.sched.trace import Trace
from roundpipe.state import STATE_FORMAT, capture_state, check_state, compute_copy_version, restore_host

LOSSES_IN_FLIGHT = 2
"""Iterations whose losses may be outstanding (`RoundPipe.forward_backward` with ``wait=False``):
enough for a loop that reads each loss one iteration late to keep the devices fed, few enough
that inputs and saved activations do not pile up on the host."""


class PendingLoss:
    """The loss of an iteration submitted by ``forward_backward(..., wait=False)``.

    ``result()`` blocks until the iteration's losses are in (not its whole backward: as with
    ``wait=True``, deep stages may still run) and returns the mean microbatch loss; it raises what
    the iteration raised, and an iteration dropped because an earlier one failed raises
    `TaskFailedError` saying so. Losses are read in submission order: waiting for one reads every
    earlier one first."""

    __slots__ = ("_dropped", "_loss_keys", "_pipe", "_value", "_weights", "iteration")

    def __init__(self, pipe: RoundPipe, iteration: int, loss_keys: list[Any], weights: list[float]) -> None:
        self._pipe = pipe
        self.iteration = iteration
        self._loss_keys = loss_keys
        self._weights = weights
        self._value: float | None = None
        self._dropped: BaseException | None = None  # what result() raises

    def done(self) -> bool:
        """Whether ``result()`` would return (or raise) without waiting."""
        return self._value is not None or self._dropped is not None

    def result(self) -> float:
        if self._value is not None:
            return self._value
        self._pipe._check_open()
        return self._pipe._runner.run(self._pipe._collect(self))

    async def aresult(self) -> float:
        if self._value is not None:
            return self._value
        self._pipe._check_open()
        return await self._pipe._runner.arun(self._pipe._collect(self))

    def __repr__(self) -> str:
        state = (
            f"loss={self._value:.6g}"
            if self._value is not None
            else "dropped"
            if self._dropped
            else "pending"
        )
        return f"PendingLoss(iteration={self.iteration}, {state})"


def _dropped_error(iteration: int, cause: BaseException) -> TaskFailedError:
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    error = TaskFailedError(
        f"iteration {iteration} was dropped before its loss was in: an earlier iteration failed ({first}); "
        "its gradients were not applied, and the next forward_backward starts cleanly",
        iteration=iteration,
    )
    error.__cause__ = cause
    return error


class RoundPipe:
    """Train a layer sequence with host-resident state and round-robin stateless workers.

    ``model``: an ``nn.Sequential`` (each child one layer) or a supported transformers
    ``*ForCausalLM`` (or a peft model wrapping one). ``optimizer``: a factory called on lists
    of fp32 parameters (one call per layer that owns trainable parameters). ``lr_scheduler``:
    an optional factory called on each optimizer. See docs/api.md."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory | None = None,
        config: RunConfig | None = None,
        *,
        lr_scheduler: SchedulerFactory | None = None,
    ) -> None:
        if config is None:
            config = RunConfig()
        if not isinstance(config, RunConfig):
            raise ConfigError(f"config must be a roundpipe.RunConfig, got {type(config).__name__}")
        self.config = config
        device_spec = config.device_spec()
        self.num_devices = device_spec.count
        # Before anything is allocated on a device: the budget, enforced where it is below the card.
        self._planner = RunPlanner(config, device_spec.kind, device_spec.indices, self.num_devices)
        apply_base_format(model, config.base_format)  # before the split: a layer may be a linear
        self._sequence = to_layer_sequence(model)
        self._model = model
        self._scaler = make_scaler(config)
        self.host = make_host(self._sequence, config, optimizer, lr_scheduler)
        self.runtime = make_runtime(self.host, self._sequence, config, self._scaler, device_spec.kind)
        self._spec = ModelSpec(param_bytes=self.host.param_bytes(), owners=tuple(self.host.owners))
        self.costs = estimated_costs(self.host, self._sequence.names)
        self.plan: Plan = self._planner.first_plan(self.costs)
        self._step_waits_for_loss = self._planner.waits_for_loss(self.plan, self.costs)
        # Fixed here, from the plan of the estimated costs: a later plan (measured on the device,
        # or re-planned) never changes which units read fresh weights, so the numerics of a run
        # depend on the model and the config alone.
        self._options = schedule_options(
            config,
            self._planner.config.round_size,
            self.runtime,
            self._spec.owners,
            one_fused_stage=self.plan.num_slots == 1,
        )
        self.runtime.fresh_units = self._options.fresh_units
        self._iteration = 0
        self._uncollected: dict[int, PendingLoss] = {}  # submitted, losses not read yet (in order)
        self._stepped_at = 0  # the iteration count at the last step(): a step needs new gradients
        self._step = 0
        self._builder = self._new_builder(base_version=0)
        self._retention = Retention(config.trace_iterations)
        self._closed = False
        self._broken: str | None = None
        self._runner = LoopRunner()
        self._backend = make_backend(device_spec.kind, device_spec.indices, self.runtime, self.costs)
        self._trace = Trace(meta=self._builder.meta())
        self._engine = Engine(self._backend, trace=self._trace, stall_timeout_s=config.stall_timeout_s)
        release = budget_release(device_spec, self._planner.budget)
        self._finalizer = weakref.finalize(self, shutdown, self._runner, self._backend, release)

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

    # ------------------------------------------------------------------ public API

    @property
    def module(self) -> nn.Module:
        """The user's module. After `synchronize()` its parameters hold the current weights."""
        return self._model

    @property
    def step_count(self) -> int:
        """Optimizer steps requested so far (`step()` calls, plus those of a loaded state)."""
        return self._step

    @property
    def fresh_units(self) -> frozenset[int]:
        """The units (layer indices of the pipe's layer sequence) that read the newest weights in
        async mode (`RunConfig.fresh_layers`, `fresh_at`, `fresh_at_if_fused`); empty in sync mode."""
        return self._options.fresh_units

    @property
    def iteration_count(self) -> int:
        """`forward_backward` calls so far (plus those of a loaded state)."""
        return self._iteration

    @overload
    def forward_backward(
        self,
        inputs: Any,
        targets: Any = ...,
        loss_fn: Callable[..., Any] | None = ...,
        *,
        wait: Literal[True] = ...,
    ) -> float: ...

    @overload
    def forward_backward(
        self,
        inputs: Any,
        targets: Any = ...,
        loss_fn: Callable[..., Any] | None = ...,
        *,
        wait: Literal[False],
    ) -> PendingLoss: ...

    def forward_backward(
        self,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[..., Any] | None = None,
        *,
        wait: bool = True,
    ) -> float | PendingLoss:
        """Run forward and backward over ``inputs`` split into microbatches; gradients accumulate
        until `step()`. Returns the mean of the microbatch losses (weighted by their sizes).

        ``wait=False`` returns a `PendingLoss` as soon as the iteration is submitted, so that the
        caller can submit the next one (``step()`` and ``forward_backward``) while this one
        computes; its ``result()`` is the loss. At most `LOSSES_IN_FLIGHT` iterations wait for
        their losses: a submission beyond that first waits for the oldest one's."""
        self._check_open()
        if wait:
            return self._runner.run(self._forward_backward(inputs, targets, loss_fn))
        return self._runner.run(self._submit_iteration(inputs, targets, loss_fn))

    @overload
    async def aforward_backward(
        self,
        inputs: Any,
        targets: Any = ...,
        loss_fn: Callable[..., Any] | None = ...,
        *,
        wait: Literal[True] = ...,
    ) -> float: ...

    @overload
    async def aforward_backward(
        self,
        inputs: Any,
        targets: Any = ...,
        loss_fn: Callable[..., Any] | None = ...,
        *,
        wait: Literal[False],
    ) -> PendingLoss: ...

    async def aforward_backward(
        self,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[..., Any] | None = None,
        *,
        wait: bool = True,
    ) -> float | PendingLoss:
        self._check_open()
        if wait:
            return await self._runner.arun(self._forward_backward(inputs, targets, loss_fn))
        return await self._runner.arun(self._submit_iteration(inputs, targets, loss_fn))

    def step(self) -> None:
        """Schedule the optimizer step (it runs on the host optimizer lane; with
        ``async_optimizer`` the next iteration does not wait for it). Also zeroes the gradients."""
        self._check_open()
        self._runner.run(self._optimizer_step())

    async def astep(self) -> None:
        self._check_open()
        await self._runner.arun(self._optimizer_step())

    def synchronize(self) -> None:
        """Wait for everything in flight; then `module` holds the current weights."""
        self._check_open()
        self._runner.run(self._synchronize())

    async def asynchronize(self) -> None:
        self._check_open()
        await self._runner.arun(self._synchronize())

    def evaluate(
        self, inputs: Any, targets: Any = None, loss_fn: Any = None, *, microbatches: int = 0
    ) -> float:
        """`forward_backward`'s loss by forward only at the current weights; see docs/api.md."""
        from roundpipe.forward_only import forward_only

        self.synchronize()
        parts = microbatches or self.config.num_microbatches
        return forward_only(self._sequence, self.runtime.device(0), inputs, targets, loss_fn, parts)

    def trace(self) -> Trace:
        """What ran (the last ``trace_iterations`` iterations), as a `roundpipe.sched.Trace`."""
        return self._trace

    def close(self) -> None:
        """Finish in-flight work, stop the engine thread and the workers. Idempotent."""
        if self._closed:
            return
        if self._broken is None:
            try:
                self._runner.run(self._synchronize())
            except Exception:  # closing must not raise for work that already failed
                pass
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RoundPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ coroutines (engine thread)

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
        # Bounded look-ahead: the oldest iteration still waiting for its losses goes first.
        while len(self._uncollected) >= LOSSES_IN_FLIGHT:
            await self._collect(next(iter(self._uncollected.values())), caller=self._iteration)
        if self._planner.claim_profile():  # claimed here, on the loop: one profile per run
            await asyncio.get_running_loop().run_in_executor(
                None, self._plan_on_device, input_parts[0], target_parts[0], loss_fn
            )
        iteration = self._iteration
        scale = self._scaler.scale if self._scaler is not None else 1.0
        self.runtime.begin_iteration(
            iteration,
            IterationData(input_parts, target_parts, weights, loss_fn, scale, self.plan.bwd_boundaries),
        )
        graph = self._builder.forward_backward(iteration, self._step, self.config.num_microbatches)
        self._iteration += 1
        self._engine.submit(graph.tasks)
        self._retention.track(iteration, graph.done_keys)
        pending = PendingLoss(self, iteration, graph.loss_keys, weights)
        self._uncollected[iteration] = pending
        return pending

    async def _collect(self, pending: PendingLoss, caller: int | None = None) -> float:
        """Wait for ``pending``'s losses (and, first, those of every earlier iteration still
        waiting: a finished iteration's losses are freed once a later one is collected).
        ``caller``: the iteration of the call that waits, if not ``pending``'s (a submission
        waiting for room), which an error then names."""
        while pending._value is None:
            if pending._dropped is not None:
                raise pending._dropped
            oldest = next(iter(self._uncollected.values()))
            iteration = oldest.iteration
            try:
                await self._engine.wait(oldest._loss_keys)
            except (TaskFailedError, ScheduleError) as exc:
                oldest._dropped = exc  # its own failure (or an earlier iteration's, named below)
                del self._uncollected[iteration]
                self._recover(exc)  # drops the iterations submitted after it
                name_earlier_iteration(exc, pending.iteration if caller is None else caller)
                raise
            losses = self.runtime.iterations[iteration].losses
            weights = oldest._weights
            oldest._value = float(sum(weights[mb] * float(losses[mb]) for mb in range(len(weights))))
            del self._uncollected[iteration]
            await self._housekeeping()
        return pending._value

    async def _collect_all(self) -> None:
        """Collect every iteration still waiting for its losses (before their tasks are freed)."""
        while self._uncollected:
            await self._collect(next(reversed(self._uncollected.values())))

    async def _optimizer_step(self) -> None:
        if self._iteration == self._stepped_at:
            raise UsageError(
                f"step() with no forward_backward since the last step (step {self._step}): there are "
                "no new gradients to apply; call forward_backward(...) first (several calls before one "
                "step() accumulate)"
            )
        if self._step_waits_for_loss and self._uncollected:  # see `RunPlanner.waits_for_loss`
            await self._collect_all()
        self._stepped_at = self._iteration
        self.runtime.collectives.step_scheduled(self._step, self._iteration - 1)  # before its tasks run
        tasks = self._builder.optimizer_step(self._step)
        self._step += 1
        self._engine.submit(tasks)

    async def _synchronize(self) -> None:
        await self._collect_all()
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

    @property
    def memory_prediction(self) -> MemoryPrediction | None:
        """The planner's predicted peak device memory of the current plan (None until the layers
        were measured: on CUDA, or with a `RunConfig.memory_budget`, at the first iteration)."""
        device_plan = self._planner.device_plan
        return None if device_plan is None else device_plan.prediction

    def _plan_on_device(self, sample: Any, target: Any, loss_fn: Any) -> None:
        """Measure the layers on the first device with one microbatch; plan within the budget."""
        prepare = self.runtime.compiler.prepare
        device = self.runtime.device(0)
        plan = self._planner.profile(
            self._sequence, self.host.dtype, device, sample, target, loss_fn, prepare=prepare
        )
        self._use_device_plan(plan)

    def _use_device_plan(self, device_plan: DevicePlan) -> None:
        self.costs = device_plan.costs
        self.runtime.memory_prediction = device_plan.prediction
        # Iterations already built keep running under the plan they were built for (OOM messages).
        self.runtime.memory_predictions[self._builder.next_iteration] = device_plan.prediction
        self._trace.meta["memory_prediction"] = device_plan.prediction.to_dict()
        self._trace.meta["memory_budget_bytes"] = device_plan.budget_bytes
        # What the planner saw: the profiled layer costs first, then the refined ones it re-planned from.
        self._trace.meta.setdefault("profiled_layer_costs", device_plan.costs.to_dict())
        self._trace.meta["layer_costs"] = device_plan.costs.to_dict()
        if device_plan.link is not None:
            self._trace.meta["link"] = device_plan.link.to_dict() | {"summary": device_plan.link.describe()}
        if device_plan.plan != self.plan:
            self.plan = device_plan.plan
            self._builder.set_plan(device_plan.plan)
            self._trace.meta["plan"] = device_plan.plan.to_dict()
        self._step_waits_for_loss = self._planner.waits_for_loss(self.plan, self.costs)  # measured costs

    def _maybe_replan(self) -> None:
        """Re-plan once from measured times (`RunPlanner.replan`) and apply the new plan."""
        times = self.runtime.times.fwd_ms
        replan: Replan | None = self._planner.replan(self.costs, self._trace, times, self._spec.param_bytes)
        if replan is None:
            return
        if replan.device_plan is not None:
            self._use_device_plan(replan.device_plan)
            return
        self.costs = replan.costs
        if replan.plan != self.plan:
            self.plan = replan.plan
            self._builder.set_plan(replan.plan)
        self._step_waits_for_loss = self._planner.waits_for_loss(replan.plan, self.costs)

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
        for pending in self._uncollected.values():  # submitted after the failure's iteration
            pending._dropped = _dropped_error(pending.iteration, error)
        self._uncollected.clear()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Weights (fp32), optimizer and scheduler state, counters, config, loss scaler, and in
        async mode the weights the next iteration will read (the P-copy still in flight).

        Works on a pipe that stopped after an error it could not recover from: the host copies
        are then saved as they are (every completed optimizer step is in them)."""
        if self._broken is None:
            self.synchronize()
        elif self._closed:
            raise PipeClosedError("this RoundPipe is closed; take state_dict() before close()")
        return capture_state(self.config, self.host, self._scaler, self._step, self._iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the run continues exactly as if it had not stopped."""
        self._check_open()
        check_state(state, self.config)
        self.synchronize()
        step = int(state["step"])
        base_version = compute_copy_version(step, self._options)
        restore_host(
            state,
            self.host,
            self._scaler,
            in_flight=base_version < step,
            fresh_units=self._options.fresh_units,
        )
        self._step = step
        self._iteration = int(state["iteration"])
        self._stepped_at = self._iteration
        self.runtime.reset()
        self._retention.clear()
        # Fresh units never defer their P-copy: their compute copy holds the newest weights.
        self._builder = self._new_builder(base_version=base_version, fresh_base_version=step)
        self.host.sync_module()


__all__ = ["LOSSES_IN_FLIGHT", "STATE_FORMAT", "PendingLoss", "RoundPipe"]
