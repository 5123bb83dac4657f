"""`RoundPipe`: the facade users call. Thin: it wires model, host copies, plan, graph builder,
engine and backend together and translates the public API into submitted task graphs.

Why a private event loop on a background thread: the engine is asyncio, but users call
`forward_backward` from scripts, notebooks whose loop is already running, other threads, or
their own services. Owning the loop means the sync API works anywhere (it blocks only the
caller's thread) and the async API (`aforward_backward`, `astep`) awaits the engine without
ever blocking the caller's loop.

It must never do tensor math itself (that is the runtime's) nor decide ordering (the rules').
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch
from torch import nn

from roundpipe.batch import microbatches
from roundpipe.config import RunConfig
from roundpipe.errors import (
    ConfigError,
    InputError,
    PipeClosedError,
    PlanError,
    ScheduleError,
    TaskFailedError,
)
from roundpipe.model.sequence import to_layer_sequence
from roundpipe.optim.host import HostModel, LossScaler, OptimizerFactory, SchedulerFactory
from roundpipe.plan import LayerCosts, Plan, choose_plan
from roundpipe.plan_eval import engine_evaluator
from roundpipe.sched.engine import Engine
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.loop import new_event_loop
from roundpipe.sched.task import GRAD_NORM, P_COPY, STEP
from roundpipe.sched.trace import Trace

T = TypeVar("T")
_STEP_KEYED = frozenset({STEP, P_COPY, GRAD_NORM})  # task kinds whose key names a step, not an iteration
STATE_FORMAT = "roundpipe.state/1"


def _estimate_costs(
    numel: tuple[int, ...], param_bytes: tuple[int, ...], names: tuple[str, ...]
) -> LayerCosts:
    """Before anything was measured: forward time proportional to parameters (plus a floor so
    parameter-free layers are not free), backward twice the forward."""
    fwd = [1e-6 * n + 1e-3 for n in numel]
    return LayerCosts(tuple(fwd), tuple(2 * f for f in fwd), tuple(param_bytes), names)


class RoundPipe:
    """Train a layer sequence with host-resident state and round-robin stateless workers.

    ``model``: an ``nn.Sequential`` (each child one layer) or a supported transformers
    ``*ForCausalLM`` (or a peft model wrapping one). ``optimizer``: a factory called on lists
    of fp32 parameters (one call per layer that owns trainable parameters). ``lr_scheduler``:
    an optional factory called on each optimizer. See docs/api.md.
    """

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
        self._sequence = to_layer_sequence(model)
        self._model = model
        self._optimizer_factory = optimizer
        self._scheduler_factory = lr_scheduler
        fp16 = config.precision == "fp16"
        self._scaler: LossScaler | None = None
        if fp16 and config.loss_scale != "none":
            if config.loss_scale == "dynamic":
                self._scaler = LossScaler()
            else:
                self._scaler = LossScaler(scale=float(config.loss_scale), dynamic=False)
        self.host = HostModel(
            self._sequence.layers,
            self._sequence.source,
            precision=config.precision,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            # Pinned host memory is what makes uploads to a GPU asynchronous and fast.
            pin_memory=torch.cuda.is_available(),
        )
        from roundpipe.backends.runtime import Runtime

        self.runtime = Runtime(
            self.host,
            self._sequence.names,
            computes_loss=self._sequence.computes_loss,
            recompute_grain=config.recompute_grain,
            seed=config.seed,
            max_grad_norm=config.max_grad_norm,
            scaler=self._scaler,
        )
        self._spec = ModelSpec(param_bytes=self.host.param_bytes(), owners=tuple(self.host.owners))
        self.costs = _estimate_costs(
            self.host.layer_numel(), self._spec.param_bytes, tuple(self._sequence.names)
        )
        self.plan: Plan = self._partition(self.costs)
        self._options = ScheduleOptions(
            async_optimizer=config.async_optimizer,
            round_size=config.round_size,
            chunk_bytes=config.chunk_bytes,
            grad_norm_barrier=config.max_grad_norm is not None or self._scaler is not None,
        )
        self._iteration = 0
        self._step = 0
        self._builder = GraphBuilder(self.plan, self._spec, self.num_devices, self._options)
        self._unfinished: list[tuple[int, list[Any]]] = []
        self._replanned = False
        self._closed = False
        self._broken: str | None = None
        # The engine's loop, on its own thread.
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="roundpipe-loop", daemon=True)
        self._thread.start()
        self._backend = self._make_backend(device_spec.kind, device_spec.indices)
        self._trace = Trace(meta=self._builder.meta())
        self._engine = Engine(self._backend, trace=self._trace, stall_timeout_s=config.stall_timeout_s)
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._backend)

    # ------------------------------------------------------------------ construction helpers

    def _make_backend(self, kind: str, indices: tuple[int, ...]) -> Any:
        if kind == "cpu":
            from roundpipe.backends.cpu import CpuBackend

            return CpuBackend(self.runtime, self.num_devices)
        if kind == "cuda":
            from roundpipe.backends.cuda import CudaBackend

            return CudaBackend(self.runtime, indices)
        from roundpipe.backends.fake import FakeBackend, FakeCostModel

        return FakeBackend(FakeCostModel(self.costs), execute=self.runtime.run)

    def _partition(self, costs: LayerCosts) -> Plan:
        try:
            return choose_plan(
                costs,
                self.num_devices,
                self.config.num_microbatches,
                self.config.mem_limit_bytes,
                async_optimizer=self.config.async_optimizer,
                round_size=self.config.round_size,
                evaluate=engine_evaluator(
                    costs,
                    self.num_devices,
                    self.config.num_microbatches,
                    async_optimizer=self.config.async_optimizer,
                    round_size=self.config.round_size,
                ),
            )
        except PlanError as exc:
            raise PlanError(
                f"{exc}\n(RoundPipe counts a layer's memory as its parameter bytes in the compute "
                f"precision {self.config.precision!r}: raise RunConfig.mem_limit_bytes "
                f"(now {self.config.mem_limit_bytes}) or use precision='bf16')"
            ) from None

    # ------------------------------------------------------------------ plumbing

    def _check_open(self) -> None:
        if self._closed:
            raise PipeClosedError("this RoundPipe is closed; create a new one")
        if self._broken is not None:
            raise PipeClosedError(
                f"this RoundPipe stopped after an error it cannot recover from ({self._broken}); "
                "save what you need with state_dict() and create a new one"
            )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("RoundPipe's synchronous API cannot be called from its own engine thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _arun(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

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
    def iteration_count(self) -> int:
        """`forward_backward` calls so far (plus those of a loaded state)."""
        return self._iteration

    def forward_backward(
        self, inputs: Any, targets: Any = None, loss_fn: Callable[..., Any] | None = None
    ) -> float:
        """Run forward and backward over ``inputs`` split into microbatches; gradients accumulate
        until `step()`. Returns the mean of the microbatch losses (weighted by their sizes)."""
        self._check_open()
        return self._run(self._forward_backward(inputs, targets, loss_fn))

    async def aforward_backward(
        self, inputs: Any, targets: Any = None, loss_fn: Callable[..., Any] | None = None
    ) -> float:
        self._check_open()
        return await self._arun(self._forward_backward(inputs, targets, loss_fn))

    def step(self) -> None:
        """Schedule the optimizer step (it runs on the host optimizer lane; with
        ``async_optimizer`` the next iteration does not wait for it). Also zeroes the gradients."""
        self._check_open()
        self._run(self._optimizer_step())

    async def astep(self) -> None:
        self._check_open()
        await self._arun(self._optimizer_step())

    def synchronize(self) -> None:
        """Wait for everything in flight; then `module` holds the current weights."""
        self._check_open()
        self._run(self._synchronize())

    async def asynchronize(self) -> None:
        self._check_open()
        await self._arun(self._synchronize())

    def trace(self) -> Trace:
        """What ran (the last ``trace_iterations`` iterations), as a `roundpipe.sched.Trace`."""
        return self._trace

    def close(self) -> None:
        """Finish in-flight work, stop the engine thread and the workers. Idempotent."""
        if self._closed:
            return
        if self._broken is None:
            try:
                self._run(self._synchronize())
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
        from roundpipe.backends.runtime import IterationData

        if loss_fn is None and not self._sequence.computes_loss:
            raise InputError(
                "loss_fn is required for this model (its last layer does not compute a loss): "
                "pass forward_backward(inputs, targets, loss_fn) with loss_fn(output, target) -> scalar"
            )
        input_parts, target_parts, weights = microbatches(inputs, targets, self.config.num_microbatches)
        iteration = self._iteration
        scale = self._scaler.scale if self._scaler is not None else 1.0
        self.runtime.begin_iteration(
            iteration,
            IterationData(input_parts, target_parts, weights, loss_fn, scale, self.plan.bwd_boundaries),
        )
        graph = self._builder.forward_backward(iteration, self._step, self.config.num_microbatches)
        self._iteration += 1
        self._engine.submit(graph.tasks)
        self._unfinished.append((iteration, graph.done_keys))
        try:
            await self._engine.wait(graph.loss_keys)
        except (TaskFailedError, ScheduleError) as exc:
            self._recover(exc)
            raise
        losses = self.runtime.iterations[iteration].losses
        loss = sum(weights[mb] * losses[mb] for mb in range(len(weights)))
        self._housekeeping()
        return float(loss)

    async def _optimizer_step(self) -> None:
        tasks = self._builder.optimizer_step(self._step)
        self._step += 1
        self._engine.submit(tasks)

    async def _synchronize(self) -> None:
        try:
            await self._engine.wait()
        except (TaskFailedError, ScheduleError) as exc:
            self._recover(exc)
            raise
        self._housekeeping()
        self.host.sync_module()

    def _housekeeping(self) -> None:
        """Free finished iterations, trim the trace, and re-plan once from measured times."""
        still = []
        for iteration, keys in self._unfinished:
            if all(self._engine.is_done(k) for k in keys):
                self.runtime.end_iteration(iteration)
            else:
                still.append((iteration, keys))
        self._unfinished = still
        keep = self.config.trace_iterations
        oldest = self._iteration - keep
        records = self._trace.records
        if records and records[0].iteration < oldest:
            self._trace.records = [
                t
                for t in records
                if t.iteration >= oldest or (t.iteration < 0 and t.step >= self._step - keep)
            ]
        # Forget finished tasks a few iterations and steps back. Keys name their iteration (device
        # tasks, G-copies) or their step (optimizer tasks) second; later tasks may still depend on
        # forgotten ones, which then count as done.
        iteration_horizon = oldest - 2
        step_horizon = self._step - 3
        self._engine.forget(
            lambda key: key[1] < (step_horizon if key[0] in _STEP_KEYED else iteration_horizon)
        )
        if self.config.replan and not self._replanned and self._iteration >= 1:
            self._maybe_replan()

    def _maybe_replan(self) -> None:
        measured = self.runtime.times.fwd_ms
        if any(ms is None for ms in measured):
            return
        self._replanned = True
        fwd = tuple(float(ms) for ms in measured)  # type: ignore[arg-type]
        self.costs = LayerCosts(
            fwd, tuple(2 * f for f in fwd), self.costs.mem_bytes, tuple(self._sequence.names)
        )
        plan = self._partition(self.costs)
        if plan != self.plan:
            self.plan = plan
            self._builder.set_plan(plan)

    def _new_builder(self, *, base_version: int) -> GraphBuilder:
        """A graph builder that continues this run's numbering from a compute copy that holds
        weight version ``base_version``."""
        return GraphBuilder(
            self.plan,
            self._spec,
            self.num_devices,
            self._options,
            first_iteration=self._iteration,
            first_step=self._step,
            base_version=base_version,
        )

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
        self._unfinished = []
        self._builder = self._new_builder(base_version=self._step)

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
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "config": self.config.model_dump(),
            "step": self._step,
            "iteration": self._iteration,
            "model": {name: master.detach().clone() for name, _, master in self.host.named_masters()},
            "host": self.host.state_dict(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
        }
        if self.config.async_optimizer:
            state["in_flight_weights"] = {name: t.clone() for name, t in self.host.named_compute()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; the run continues exactly as if it had not stopped."""
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError("not a RoundPipe state_dict (missing or unknown 'format')")
        if bool(state["config"]["async_optimizer"]) != self.config.async_optimizer:
            raise ConfigError(
                "the state was saved with async_optimizer="
                f"{state['config']['async_optimizer']} but this pipe uses {self.config.async_optimizer}; "
                "resume with the same mode"
            )
        self.synchronize()
        masters = {name: (param, master) for name, param, master in self.host.named_masters()}
        missing = set(masters) - set(state["model"])
        unexpected = set(state["model"]) - set(masters)
        if missing or unexpected:
            raise ConfigError(
                f"state_dict does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            for name, (_, master) in masters.items():
                master.copy_(state["model"][name])
            self.host.load_state_dict(state["host"])
            self.host.drop_gradients()
            if self.config.async_optimizer and "in_flight_weights" in state:
                compute = dict(self.host.named_compute())
                for name, tensor in state["in_flight_weights"].items():
                    compute[name].copy_(tensor)
            else:
                self.host.p_copy_all()
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self._step = int(state["step"])
        self._iteration = int(state["iteration"])
        # In async mode the compute copy holds the weights before the last step (version step-1).
        base = self._step - 1 if self.config.async_optimizer and self._step > 0 else self._step
        self.runtime.reset()
        self._unfinished = []
        self._builder = self._new_builder(base_version=base)
        self.host.sync_module()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, backend: Any) -> None:
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    backend.close()
    if not loop.is_running():
        loop.close()
