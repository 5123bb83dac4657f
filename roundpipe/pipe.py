"""`RoundPipe`: the facade users call. Thin: it wires model, host copies, plan, graph builder,
engine and backend together and translates the public API into submitted task graphs.

What it delegates: the engine's loop thread (`roundpipe.loop_thread`), which plan runs and when it
is re-planned (`roundpipe.planning.replan`), what is kept how long (`roundpipe.retention`), and the
state format (`roundpipe.state`), the losses not read yet (`roundpipe.pending`), and what runs
on the loop thread to carry each call out: driving iterations and steps, applying a new plan,
recovery after a failed task (`roundpipe.pipe_machinery`, its base class). What it keeps: the
public API, the wiring, and when state is captured or restored.
It must never do tensor math itself (that is the runtime's) nor decide ordering (the rules').
"""

from __future__ import annotations

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
from roundpipe.config import RunConfig
from roundpipe.errors import ConfigError, PipeClosedError
from roundpipe.loop_thread import LoopRunner, shutdown
from roundpipe.model.quant import apply_base_format
from roundpipe.model.sequence import to_layer_sequence
from roundpipe.optim.host import OptimizerFactory, SchedulerFactory
from roundpipe.pending import LOSSES_IN_FLIGHT, LossLedger, PendingLoss
from roundpipe.pipe_machinery import PipeMachinery
from roundpipe.plan import Plan
from roundpipe.plan.memory import MemoryPrediction
from roundpipe.planning.device_plan import budget_release
from roundpipe.planning.replan import RunPlanner
from roundpipe.retention import Retention
from roundpipe.sched.engine import Engine
from roundpipe.sched.graph import ModelSpec
from roundpipe.sched.trace import Trace
from roundpipe.state import STATE_FORMAT, capture_state, check_state, compute_copy_version, restore_host


class RoundPipe(PipeMachinery):
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
        self._spec = ModelSpec(
            param_bytes=self.host.param_bytes(),
            owners=tuple(self.host.owners),
            grad_bytes=self.host.param_bytes(trainable=True),
        )
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
        self._stepped_at = 0  # the iteration count at the last step(): a step needs new gradients
        self._step = 0
        self._builder = self._new_builder(base_version=0)
        self._retention = Retention(config.trace_iterations)
        self._closed = False
        self._broken: str | None = None
        self._runner = LoopRunner()
        self._backend = make_backend(device_spec.kind, device_spec.indices, self.runtime, self.costs)
        # The grain until a plan made on the device chooses ("auto"): `pipe_machinery._use_device_plan`.
        self._trace = Trace(meta=self._builder.meta() | {"recompute_grain": self.runtime.recompute_grain})
        self._engine = Engine(self._backend, trace=self._trace, stall_timeout_s=config.stall_timeout_s)
        self._losses = LossLedger(self._engine, self.runtime)
        release = budget_release(device_spec, self._planner.budget)
        self._finalizer = weakref.finalize(self, shutdown, self._runner, self._backend, release)

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

    @property
    def memory_prediction(self) -> MemoryPrediction | None:
        """The planner's predicted peak device memory of the current plan (None until the layers
        were measured: on CUDA, or with a `RunConfig.memory_budget`, at the first iteration)."""
        device_plan = self._planner.device_plan
        return None if device_plan is None else device_plan.prediction

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
