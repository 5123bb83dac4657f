"""What each task kind does to tensors, for any torch device.

Why one runtime for every real backend: the CPU workers and the CUDA streams must give the same
numbers, so what every task does (upload into a transient copy, the stage math of
`roundpipe.backends.stage_math` over the layer calls of `roundpipe.backends.replicas`, gradient
download; the optimizer-lane operations of `roundpipe.backends.optimizer_lane`, a base of `Runtime`)
is written once against a `torch.device`; backends only decide which thread or stream runs it and
how completion is reported.

Data flow of one microbatch through a plan, all keyed by `BoundaryKey` (iteration, layer, microbatch):
  host inputs -> F1 -> ... -> Fk -> FB (loss, backward) -> Bk -> ... -> B1
  forward stages save the activation entering every layer where a backward stage starts
  (`boundaries`); a backward stage fetches it and recomputes (`recompute`, the graph kept in
  `recomputed` by (iteration, slot, microbatch)), then fetches the gradient (`grad_up`),
  back-propagates it (`compute`) and sends the input gradient down.

Activation convention (`roundpipe.backends.tensors`, docs/models.md): floating-point tensors are differentiable;
integer/bool tensors are not; dict entries whose key starts with "_" are constants.

This module must never decide when anything runs: that is the engine's job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from roundpipe.backends.compiling import NO_COMPILE, CompileGarbage, LayerCompiler
from roundpipe.backends.dense_runs import DenseRuns
from roundpipe.backends.holdings import TaskHolds, out_of_memory_error
from roundpipe.backends.host_data import BoundaryKey, IterationData, LayerTimes, LossFn, RunKey, SlotKey
from roundpipe.backends.optimizer_lane import OptimizerLane
from roundpipe.backends.out_of_memory import is_out_of_memory
from roundpipe.backends.packed_download import download_together
from roundpipe.backends.replicas import Replicas
from roundpipe.backends.stage_math import (
    Recomputed,
    ResidualOf,
    backward_stage,
    forward_stage,
    fused_stage,
    recompute_stage,
)
from roundpipe.backends.storages import record_moved
from roundpipe.backends.tensors import (
    TransientPool,
    cast_floating,
    chunk_spans,
    download,
    download_fp32,
    gradient_chunk_elements,
    pop_frozen,
    to_device,
)
from roundpipe.errors import DeviceOutOfMemoryError, StageError
from roundpipe.model.dense_weights import add_dense_slots
from roundpipe.optim.distributed import LOCAL, Collectives
from roundpipe.optim.host import HostModel
from roundpipe.plan.kinds import Grain, SlotKind
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    GRAD_UP,
    P_COPY,
    PARAM_UP,
    RECOMPUTE,
    STEP,
    Task,
)


class Runtime(OptimizerLane, TaskHolds):
    """Executes tasks on tensors. Shared by every device of a backend; thread-safe per lane."""

    skip_unread_tail = True  # RunConfig.skip_unread_tail (`roundpipe.model.frozen_tail`)
    save_residuals = False  # beside layer_input's inputs (`roundpipe.model.attention_residual`)

    def __init__(
        self,
        host: HostModel,
        names: list[str],
        *,
        computes_loss: bool,
        recompute_grain: Grain = "stage",
        seed: int = 0,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        chunk_bytes: int | None = None,
        compiler: LayerCompiler | None = None,
        predict_from: int | None = None,
        lr_scale: Callable[[int], float] = lambda step: 1.0,
    ) -> None:
        self.host = host
        # Fresh units read their own step's weights: nothing to predict. The facade sets them from
        # ScheduleOptions.fresh_units, which is built after the runtime (it reads its collectives).
        self.fresh_units: frozenset[int] = frozenset()
        # Weight prediction: P-copies of steps >= predict_from extrapolate (None: never), and those
        # steps keep the weights they start from; lr_scale(step): the async lr ramp (optim/lr_ramp.py).
        self.predict_from, self.lr_scale = predict_from, lr_scale
        self.layers, self.names, self.computes_loss = host.layers, names, computes_loss
        self.recompute_grain, self.seed, self.max_grad_norm = recompute_grain, seed, max_grad_norm
        # (1-based step, norm) of the first step whose global gradient norm was NaN/inf, when a
        # norm is computed (max_grad_norm) and no loss scaler skips such steps.
        self.non_finite_grad_norm: tuple[int, float] | None = None
        self.scaler = scaler
        self.chunk_elements = gradient_chunk_elements(chunk_bytes)
        self.iterations: dict[int, IterationData] = {}
        self.activations: dict[BoundaryKey, Any] = {}
        self.gradients: dict[BoundaryKey, list[torch.Tensor | None]] = {}
        self.residuals: dict[BoundaryKey, torch.Tensor] = {}  # beside the inputs (`attention_residual`)
        self.inbox: dict[SlotKey, Any] = {}  # uploaded stage inputs (of a backward stage: its activation)
        self.grad_inbox: dict[SlotKey, Any] = {}  # uploaded gradients entering backward stages
        self.recomputed: dict[SlotKey, Recomputed] = {}  # a backward stage's recompute, until its backward
        self.outbox: dict[SlotKey, Any] = {}  # stage outputs to download
        self.transient: dict[RunKey, dict[int, dict[str, torch.Tensor]]] = {}  # run -> layer -> params
        # 4-bit frozen weights dequantized once per stage run; the facade turns it on.
        self.dense = DenseRuns(self.layers, host.dtype)
        self.compiler = compiler or NO_COMPILE
        # Compiling leaves device tensors in cyclic garbage: freed right after the task that compiled.
        self.compile_garbage = CompileGarbage() if self.compiler.enabled else None
        self.replicas = Replicas(
            self.layers, names, self.device, self._out_of_memory, seed=seed, prepare=self.prepare_replica
        )
        self.uses_rng = self.replicas.uses_rng
        self._call = self.replicas.call
        self.times = LayerTimes([None] * len(self.layers))
        self.pool = TransientPool()
        self._spans: dict[tuple[int, int], list[list[tuple[int, int, int]]]] = {}  # (layer, chunks)
        self.devices: dict[int, torch.device] = {}
        # Backends that issue device work ahead of its completion set this: what a task's work
        # reads on another stream is then kept alive until the task has run (`hold`, `finish`).
        self.defer_release = False
        self.memory_prediction: Any = None  # the plan's, when the layers were measured (OOM messages)
        self.memory_predictions: dict[int, Any] = {}  # first iteration of a plan -> its prediction
        self._holds, self._holds_lock = {}, threading.Lock()  # `TaskHolds`
        self.collectives: Collectives = LOCAL  # gradient averaging across processes, when any

    # ------------------------------------------------------------------ setup

    def prepare_replica(self, module: nn.Module) -> nn.Module:
        """A new layer copy as the runs call it: with empty ``dense`` slots (filled only for runs
        that dequantize once, `DenseRuns`), compiled where the run compiles. The profile's copies
        are prepared so too, so a call that dequantizes inside reuses the profile's compiled code."""
        add_dense_slots(module)
        return self.compiler.prepare(module)

    def device(self, index: int) -> torch.device:
        return self.devices.get(index, torch.device("cpu"))

    def begin_iteration(self, iteration: int, data: IterationData) -> None:
        self.iterations[iteration] = data

    def _stores(self) -> tuple[dict[Any, Any], ...]:
        """The per-iteration tensor stores; every key of them has an ``iteration``."""
        moving = (self.activations, self.gradients, self.inbox, self.grad_inbox, self.recomputed, self.outbox)
        return (*moving, self.residuals, self.transient, self.dense.runs)

    def end_iteration(self, iteration: int) -> None:
        self.iterations.pop(iteration, None)
        for store in self._stores():
            for key in [k for k in store if k.iteration == iteration]:
                del store[key]

    def reset(self) -> None:
        """Drop everything in flight (after a failure)."""
        self.iterations.clear()
        for store in self._stores():
            store.clear()

    # ------------------------------------------------------------------ dispatch

    def run(self, task: Task) -> None:
        handler = _HANDLERS[task.kind]
        try:
            handler(self, task)
        except StageError:
            raise
        except Exception as exc:
            # Also an out-of-memory that inductor re-raised as a plain error while compiling a new
            # graph variant mid-run: the user should see the prediction, not a broken layer.
            if is_out_of_memory(exc):
                raise self._out_of_memory(task, "") from exc
            raise
        if task.kind == COMPUTE:
            self.dense.drop(task)
            if task.part == task.num_parts - 1:  # a run's last compute: a forward run's weights go,
                # a fused or backward run's frozen ones (what trains waits for grad_down)
                run = RunKey(task.device, task.iteration, task.round, task.slot)
                forward = task.stage_kind == SlotKind.FWD
                self._release(
                    task, self.transient.pop(run, {}) if forward else pop_frozen(self.transient.get(run, {}))
                )
        if self.compile_garbage is not None and task.kind in (COMPUTE, RECOMPUTE):
            self.compile_garbage.collect_if_compiled()

    def _out_of_memory(self, task: Task, where: str) -> DeviceOutOfMemoryError:
        return out_of_memory_error(self, task, where)

    # ------------------------------------------------------------------ device lanes

    def param_up(self, task: Task) -> None:
        layer = task.layers.start
        device = self.device(task.device)
        run = RunKey(task.device, task.iteration, task.round, task.slot)
        params = self.transient.setdefault(run, {}).setdefault(layer, {})
        named = self.host.layer_params[layer]
        needs_grad = task.stage_kind != SlotKind.FWD
        if task.num_parts == 1:
            for name, param in named:
                source = self.host.compute[id(param)]
                params[name] = self.pool.copy_of(source, device, needs_grad and param.requires_grad)
            return
        # A chunk is a byte range of the layer's parameters laid end to end: large tensors are
        # cut, so no single copy holds a link longer than one chunk. Which tensors each chunk
        # overlaps is found once per layer (`chunk_spans`): a chunk overlaps one or two of them.
        spans = self._spans.get((layer, task.num_parts))
        if spans is None:
            sources = [self.host.compute[id(param)] for _, param in named]
            sizes = [(src.numel() * src.element_size(), src.element_size()) for src in sources]
            spans = self._spans[(layer, task.num_parts)] = chunk_spans(sizes, task.num_parts)
        for index, first, last in spans[task.part]:
            name, param = named[index]
            src = self.host.compute[id(param)]
            dst = params.get(name)
            if dst is None:
                dst = params[name] = self.pool.empty_like(src, device, needs_grad and param.requires_grad)
            with torch.no_grad():
                dst.view(-1)[first:last].copy_(src.view(-1)[first:last], non_blocking=device.type == "cuda")

    def act_up(self, task: Task) -> None:
        t, mb, start = task.iteration, task.microbatch, task.layers.start
        device = self.device(task.device)
        if task.stage_kind == SlotKind.BWD and self.recompute_grain == "layer_input":  # with residuals
            keys = [BoundaryKey(t, layer, mb) for layer in task.layers]
            value: Any = [(self._saved_input(*k), self.residuals.pop(k, None)) for k in keys]
        elif task.stage_kind == SlotKind.FWD and start > 0 and start in self.iterations[t].boundaries:
            value = self.activations[BoundaryKey(t, start, mb)]  # a backward stage reads it again
        else:
            value = self._saved_input(t, start, mb)
        self.inbox[SlotKey(t, task.slot, mb)] = to_device(value, device, device.type == "cuda")
        record_moved(task, value)
        if self.defer_release:
            self.hold(task, value)  # the host tensors the copy reads

    def _saved_input(self, iteration: int, layer: int, microbatch: int) -> Any:  # layer 0's: the data
        if layer == 0:
            return cast_floating(self.iterations[iteration].inputs[microbatch], self.host.dtype)
        return self.activations.pop(BoundaryKey(iteration, layer, microbatch))

    def grad_up(self, task: Task) -> None:
        """A backward stage's incoming gradient, uploaded apart from its saved activation."""
        t, mb = task.iteration, task.microbatch
        device = self.device(task.device)
        grad = self.gradients.pop(BoundaryKey(t, task.layers.stop, mb))
        self.grad_inbox[SlotKey(t, task.slot, mb)] = to_device(grad, device, device.type == "cuda")
        record_moved(task, grad)
        if self.defer_release:
            self.hold(task, grad)  # the host tensors the copy reads

    def act_down(self, task: Task) -> None:
        t, mb = task.iteration, task.microbatch
        produced = self.outbox.pop(SlotKey(t, task.slot, mb), None)
        if produced is None:
            return
        kind, payload = produced
        record_moved(task, payload)
        if self.defer_release:
            self.hold(task, payload)  # computed on the compute stream, read by this copy
        values = list(payload.values())
        # A forward stage's activations into shared pinned pieces, not one rounded allocation each.
        hosts = download_together(values) if kind == "act" else [download(v) for v in values]
        for layer, host_value in zip(payload, hosts, strict=True):
            if isinstance(layer, ResidualOf):
                self.residuals[BoundaryKey(t, layer.layer, mb)] = host_value
            elif kind == "act":
                self.activations[BoundaryKey(t, layer, mb)] = host_value
            else:
                self.gradients[BoundaryKey(t, layer, mb)] = host_value

    def grad_down(self, task: Task) -> None:
        params = self.transient.pop(RunKey(task.device, task.iteration, task.round, task.slot), {})
        landings: list[tuple[int, str, torch.Tensor]] = []
        for layer, named in params.items():
            buffers = self.host.grad_buffers[layer]
            for name, tensor in named.items():
                grad = tensor.grad
                if grad is None or name not in buffers:
                    continue
                if grad.device.type == "cpu":
                    self.host.land_gradient(layer, name, grad)
                    continue
                # Converted to fp32 on the device a chunk at a time, straight into a recycled
                # pinned buffer; the host adds it in only once the copy has completed.
                landing = self.host.take_pinned(grad.shape)
                download_fp32(grad, landing, self.chunk_elements)
                landings.append((layer, name, landing))
        if landings:
            host = self.host

            def land() -> None:
                for layer, name, landing in landings:
                    host.land_gradient(layer, name, landing)

            self.hold(task, params, land)
        else:
            self._release(task, params)

    def _release(self, task: Task, params: dict[int, dict[str, torch.Tensor]]) -> None:
        """A run's transient weights are no longer needed once ``task`` has run."""
        if self.defer_release:
            self.hold(task, params)
        else:
            self.pool.release(params)

    def compute(self, task: Task) -> None:
        """A forward or fused stage over one microbatch, or a backward stage's backward (its
        recompute ran as the task before it on the same lane: `recompute`)."""
        t, mb = task.iteration, task.microbatch
        key = SlotKey(t, task.slot, mb)
        run = RunKey(task.device, t, task.round, task.slot)
        params = self.dense.params(run, self.transient)
        if task.stage_kind == SlotKind.BWD:
            grad = self.grad_inbox.pop(key)
            state = self.recomputed.pop(key)
            if self.defer_release:
                # Both were uploaded on another stream: the gradient, and the saved activation the
                # recompute's graph still reads during this backward (its leaves share that storage;
                # ``state.uploaded`` keeps the rest of it, such as constants only the graph saved).
                self.hold(task, grad, state)
            grads = backward_stage(self._call, task, params, state, grad, skip_tail=self.skip_unread_tail)
            self.outbox[key] = ("grad", grads)
            return
        value = self.inbox.pop(key)
        if self.defer_release:
            self.hold(task, value)  # uploaded on another stream
        data = self.iterations[t]
        if task.stage_kind == SlotKind.FWD:
            on_cpu = task.device >= 0 and self.device(task.device).type == "cpu"
            record = self.times.add if on_cpu else None
            self.outbox[key] = ("act", forward_stage(self._call, data, task, params, value, record))
        else:
            device = self.device(task.device)
            fused = fused_stage(
                self._call, data, task, params, value, computes_loss=self.computes_loss, device=device
            )
            self.outbox[key] = ("grad", fused)

    def recompute(self, task: Task) -> None:
        """A backward stage's forward again from its saved activation; what its backward needs
        stays on the device until that backward pops it. With deferred releases (CUDA) the uploaded
        activation goes with it, whole, for the backward to hold until it has run: the act_up
        stream allocated it and the graph saves some of its tensors (the rotary tables) that
        nothing else keeps (docs/design.md, "A backward stage is two compute tasks")."""
        key = SlotKey(task.iteration, task.slot, task.microbatch)
        value = self.inbox.pop(key)
        if self.defer_release:
            self.hold(task, value)  # uploaded on another stream
        params = self.dense.params(RunKey(task.device, task.iteration, task.round, task.slot), self.transient)
        state = recompute_stage(
            self._call, task, params, value, grain=self.recompute_grain, skip_tail=self.skip_unread_tail
        )
        if self.defer_release:
            state.uploaded = value
        self.recomputed[key] = state


_HANDLERS: dict[str, Callable[[Runtime, Task], None]] = {
    PARAM_UP: Runtime.param_up,
    ACT_UP: Runtime.act_up,
    GRAD_UP: Runtime.grad_up,
    RECOMPUTE: Runtime.recompute,
    COMPUTE: Runtime.compute,
    ACT_DOWN: Runtime.act_down,
    GRAD_DOWN: Runtime.grad_down,
    G_COPY: Runtime.g_copy,
    GRAD_NORM: Runtime.grad_norm,
    STEP: Runtime.step,
    P_COPY: Runtime.p_copy,
}


__all__ = ["IterationData", "LossFn", "Runtime"]
