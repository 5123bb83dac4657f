"""Stage math: what each task kind does to tensors, for any torch device.

Why one runtime for every real backend: the CPU workers and the CUDA streams must give the same
numbers, so the math (upload into a transient copy, forward stages that save boundary
activations, the fused stage, recompute + backward, gradient download, the optimizer-lane
operations) is written once against a `torch.device`; backends only decide which thread or
stream runs it and how completion is reported.

Data flow of one microbatch through a plan, all keyed by `BoundaryKey` (iteration, layer, microbatch):
  host inputs -> F1 -> ... -> Fk -> FB (loss, backward) -> Bk -> ... -> B1
  forward stages save the activation entering every layer where a backward stage starts
  (`boundaries`), backward stages fetch it, recompute, and send the input gradient down.

Activation convention (`roundpipe.backends.tensors`, docs/models.md): floating-point tensors are differentiable;
integer/bool tensors are not; dict entries whose key starts with "_" are constants.

This module must never decide when anything runs: that is the engine's job.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from roundpipe.backends.host_data import (
    BoundaryKey,
    IterationData,
    LayerTimes,
    LossFn,
    ReplicaKey,
    RunKey,
    SlotKey,
)
from roundpipe.backends.tensors import (
    TransientPool,
    cast_floating,
    differentiable_leaves,
    download,
    download_fp32,
    element_span,
    part_range,
    to_device,
    with_leaves,
)
from roundpipe.errors import DeviceOutOfMemoryError, StageError
from roundpipe.optim.host import HostModel
from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    P_COPY,
    PARAM_UP,
    STEP,
    Task,
)


class Runtime:
    """Executes tasks on tensors. Shared by every device of a backend; thread-safe per lane."""

    def __init__(
        self,
        host: HostModel,
        names: list[str],
        *,
        computes_loss: bool,
        recompute_grain: str = "stage",
        seed: int = 0,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self.host = host
        self.layers = host.layers
        self.names = names
        self.computes_loss = computes_loss
        self.recompute_grain = recompute_grain
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.chunk_elements = max(1, (chunk_bytes or 64 << 20) // 4)  # fp32 elements per gradient chunk
        self.iterations: dict[int, IterationData] = {}
        self.activations: dict[BoundaryKey, Any] = {}
        self.gradients: dict[BoundaryKey, list[torch.Tensor | None]] = {}
        self.inbox: dict[SlotKey, Any] = {}  # uploaded stage inputs
        self.outbox: dict[SlotKey, Any] = {}  # stage outputs to download
        self.transient: dict[RunKey, dict[int, dict[str, torch.Tensor]]] = {}  # run -> layer -> params
        self._replicas: dict[ReplicaKey, nn.Module] = {}
        self._binders: dict[ReplicaKey, _Binder] = {}
        self._replica_lock = threading.Lock()
        self._rng_lock = threading.Lock()
        self.uses_rng = any(
            isinstance(m, nn.Dropout) and m.p > 0 for layer in self.layers for m in layer.modules()
        ) or any(getattr(getattr(layer, "config", None), "attention_dropout", 0.0) for layer in self.layers)
        self.times = LayerTimes([None] * len(self.layers))
        self.pool = TransientPool()
        self.devices: dict[int, torch.device] = {}
        # Backends that issue device work ahead of its completion set this: what a task's work
        # reads on another stream is then kept alive until the task has run (`hold`, `finish`).
        self.defer_release = False
        self.memory_prediction: Any = None  # the plan's, when the layers were measured (OOM messages)
        self._holds: dict[Any, list[Any]] = {}
        self._holds_lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    def device(self, index: int) -> torch.device:
        return self.devices.get(index, torch.device("cpu"))

    def replica(self, device: int, layer: int) -> nn.Module:
        """A per-device structural copy of a layer whose parameters are empty placeholders
        (the transient copy is passed in at call time), with its own buffers."""
        key = ReplicaKey(device, layer)
        module = self._replicas.get(key)
        if module is not None:
            return module
        with self._replica_lock:
            module = self._replicas.get(key)
            if module is None:
                original = self.layers[layer]
                memo: dict[int, Any] = {
                    id(p): nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                    for p in original.parameters()
                }
                module = copy.deepcopy(original, memo)
                module.to(self.device(device))
                self._binders[key] = _Binder(module)
                self._replicas[key] = module
        return module

    def begin_iteration(self, iteration: int, data: IterationData) -> None:
        self.iterations[iteration] = data

    def _stores(self) -> tuple[dict[Any, Any], ...]:
        """The per-iteration tensor stores; every key of them has an ``iteration``."""
        return (self.activations, self.gradients, self.inbox, self.outbox, self.transient)

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
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(task, "") from exc

    def _out_of_memory(self, task: Task, where: str) -> DeviceOutOfMemoryError:
        """Running out of memory on a plan that was predicted to fit is a bug in the prediction:
        the error says what was predicted and what the device measured."""
        device = self.device(task.device)
        note = ""
        if self.memory_prediction is not None:
            note = f"; the plan's {self.memory_prediction.describe()}"
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            note += f"; measured peak on {device}: {peak / 2**30:.2f} GiB"
        return DeviceOutOfMemoryError(
            f"out of memory in {where}{task.kind} of stage {task.stage} on device {task.device}, "
            f"microbatch {task.microbatch}{note}. Use more microbatches (smaller ones), "
            'recompute_grain="layer", a shorter sequence, or a smaller RunConfig.memory_budget so the plan '
            "makes smaller stages",
            task.describe(),
        )

    def hold(self, task: Task, *items: Any) -> None:
        """Keep ``items`` alive until ``task`` has run; a callable among them runs then (host work
        on the task's results, such as landing a downloaded gradient)."""
        with self._holds_lock:
            self._holds.setdefault(task.key, []).extend(items)

    def finish(self, task: Task, *, failed: bool = False) -> None:
        """Called by the backend once ``task``'s work has completed (at once on the CPU)."""
        if not self._holds:
            return
        with self._holds_lock:
            items = self._holds.pop(task.key, ())
        if failed:
            return
        for item in items:
            if callable(item):
                item()

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
        # cut, so no single copy holds a link longer than one chunk.
        sources = [(name, param, self.host.compute[id(param)]) for name, param in named]
        total = sum(src.numel() * src.element_size() for _, _, src in sources)
        low, high = part_range(total, task.part, task.num_parts)
        offset = 0
        for name, param, src in sources:
            size = src.numel() * src.element_size()
            first, last = element_span(offset, size, src.element_size(), low, high)
            offset += size
            if first >= last:
                continue
            dst = params.get(name)
            if dst is None:
                dst = params[name] = self.pool.empty_like(src, device, needs_grad and param.requires_grad)
            with torch.no_grad():
                dst.view(-1)[first:last].copy_(src.view(-1)[first:last], non_blocking=device.type == "cuda")

    def act_up(self, task: Task) -> None:
        t, mb, start = task.iteration, task.microbatch, task.layers.start
        data = self.iterations[t]
        device = self.device(task.device)
        entry, exit_ = BoundaryKey(t, start, mb), BoundaryKey(t, task.layers.stop, mb)
        if start == 0 and task.stage_kind != SlotKind.BWD:
            value: Any = cast_floating(data.inputs[mb], self.host.dtype)
        elif start == 0:
            value = (cast_floating(data.inputs[mb], self.host.dtype), self.gradients.pop(exit_))
        elif task.stage_kind == SlotKind.FWD:
            value = self.activations[entry] if start in data.boundaries else self.activations.pop(entry)
        elif task.stage_kind == SlotKind.FUSED:
            value = self.activations.pop(entry)
        else:
            value = (self.activations.pop(entry), self.gradients.pop(exit_))
        self.inbox[SlotKey(t, task.slot, mb)] = to_device(value, device, device.type == "cuda")
        if self.defer_release:
            self.hold(task, value)  # the host tensors the copy reads

    def act_down(self, task: Task) -> None:
        t, mb = task.iteration, task.microbatch
        produced = self.outbox.pop(SlotKey(t, task.slot, mb), None)
        if produced is None:
            return
        kind, payload = produced
        if self.defer_release:
            self.hold(task, payload)  # computed on the compute stream, read by this copy
        for layer, value in payload.items():
            host_value = download(value)
            if kind == "act":
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
        t, mb = task.iteration, task.microbatch
        key = SlotKey(t, task.slot, mb)
        value = self.inbox.pop(key)
        if self.defer_release:
            self.hold(task, value)  # uploaded on another stream
        run = RunKey(task.device, t, task.round, task.slot)
        params = self.transient.get(run, {})
        if task.stage_kind == SlotKind.FWD:
            self.outbox[key] = ("act", self._forward_stage(task, params, value))
            if task.part == task.num_parts - 1:  # last microbatch of the run: free the transient copy
                self._release(task, self.transient.pop(run, {}))
        elif task.stage_kind == SlotKind.FUSED:
            self.outbox[key] = ("grad", self._fused_stage(task, params, value))
        else:
            act, grad = value
            self.outbox[key] = ("grad", self._backward_stage(task, params, act, grad))

    # ------------------------------------------------------------------ stage kinds

    def _forward_stage(
        self, task: Task, params: dict[int, dict[str, torch.Tensor]], x: Any
    ) -> dict[int, Any]:
        data = self.iterations[task.iteration]
        saved: dict[int, Any] = {}
        with torch.no_grad():
            for layer in task.layers:
                if layer != task.layers.start and layer in data.boundaries:
                    saved[layer] = x
                started = time.perf_counter()
                x = self._call(task, layer, params, x)
                if task.device >= 0 and self.device(task.device).type == "cpu":
                    self.times.add(layer, (time.perf_counter() - started) * 1e3)
        saved[task.layers.stop] = x
        return saved

    def _fused_stage(self, task: Task, params: dict[int, dict[str, torch.Tensor]], x: Any) -> dict[int, Any]:
        t, mb = task.iteration, task.microbatch
        data = self.iterations[t]
        start = task.layers.start
        x, leaves = with_leaves(x) if start > 0 else (x, [])
        with torch.enable_grad():
            out = x
            for layer in task.layers:
                out = self._call(task, layer, params, out)
            if self.computes_loss or data.loss_fn is None:
                loss = out
            else:
                target = to_device(data.targets[mb], self.device(task.device))
                try:
                    # The loss is computed in fp32 whatever the compute precision.
                    loss = data.loss_fn(cast_floating(out, torch.float32), target)
                except Exception as exc:
                    raise StageError(
                        f"loss_fn raised {type(exc).__name__}: {exc} (stage {task.stage} on device "
                        f"{task.device}, microbatch {mb}, iteration {t})",
                        task.describe(),
                    ) from exc
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = (
                    type(loss).__name__
                    if not isinstance(loss, torch.Tensor)
                    else f"shape {tuple(loss.shape)}"
                )
                raise StageError(
                    f"the loss must be a scalar tensor, got {what} (stage {task.stage}, microbatch {mb}); "
                    "pass a loss_fn(output, target) that returns a scalar, or a model whose last layer does",
                    task.describe(),
                )
            scaled = loss.reshape(()) * (data.weights[mb] * data.loss_scale)
            scaled.backward()
        data.losses[mb] = loss.detach()  # no host sync here: read once the task is done
        return {start: [leaf.grad if leaf is not None else None for leaf in leaves]}

    def _backward_stage(
        self, task: Task, params: dict[int, dict[str, torch.Tensor]], act: Any, grad_out: list[Any]
    ) -> dict[int, Any]:
        start = task.layers.start
        if self.recompute_grain == "layer" and len(task.layers) > 1:
            inputs = []
            x = act
            with torch.no_grad():
                for layer in task.layers:
                    inputs.append(x)
                    x = self._call(task, layer, params, x)
            grads: list[Any] = grad_out
            for layer, layer_input in zip(reversed(task.layers), reversed(inputs), strict=True):
                grads = self._backprop(task, range(layer, layer + 1), params, layer_input, grads, layer > 0)
            return {start: grads}
        return {start: self._backprop(task, task.layers, params, act, grad_out, start > 0)}

    def _backprop(
        self,
        task: Task,
        layers: range,
        params: dict[int, dict[str, torch.Tensor]],
        act: Any,
        grad_out: list[Any],
        input_grads: bool,
    ) -> list[torch.Tensor | None]:
        x, leaves = with_leaves(act) if input_grads else (act, [])
        with torch.enable_grad():
            out = x
            for layer in layers:
                out = self._call(task, layer, params, out)
            outputs = differentiable_leaves(out)
            pairs = [
                (o, g.to(o.device, o.dtype))
                for o, g in zip(outputs, grad_out, strict=False)
                if o is not None and g is not None and o.requires_grad
            ]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        return [leaf.grad if leaf is not None else None for leaf in leaves]

    def _call(self, task: Task, layer: int, params: dict[int, dict[str, torch.Tensor]], x: Any) -> Any:
        replica = self.replica(task.device, layer)
        binder = self._binders[ReplicaKey(task.device, layer)]
        try:
            with self._rng(task.iteration, layer, task.microbatch):
                binder.bind(params.get(layer, {}))
                try:
                    return replica(x)
                finally:
                    binder.unbind()  # the replica must not keep a finished run's weights alive
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(task, f"layer {layer} ({self.names[layer]}), ") from exc
        except StageError:
            raise
        except Exception as exc:
            raise StageError(
                f"layer {layer} ({self.names[layer]}) raised {type(exc).__name__}: {exc} "
                f"(stage {task.stage} on device {task.device}, microbatch {task.microbatch}, "
                f"iteration {task.iteration})",
                task.describe(),
            ) from exc

    def _rng(self, iteration: int, layer: int, microbatch: int) -> AbstractContextManager[Any]:
        """Dropout masks depend only on (seed, iteration, layer, microbatch): the same in the
        forward and in recompute, and the same on any number of devices. The CPU generator is
        global, so seeded sections are serialised."""
        if not self.uses_rng:
            return nullcontext()
        return _SeededSection(self._rng_lock, hash((self.seed, iteration, layer, microbatch)) & 0x7FFF_FFFF)

    # ------------------------------------------------------------------ optimizer lane

    def g_copy(self, task: Task) -> None:
        data = self.iterations.get(task.iteration)
        self.host.g_copy(task.layers.start, data.loss_scale if data is not None else 1.0)

    def grad_norm(self, task: Task) -> None:
        check = self.scaler is not None
        self.host.grad_norm(self.max_grad_norm, check)
        if self.scaler is not None:
            self.scaler.update(self.host.found_inf)

    def step(self, task: Task) -> None:
        self.host.step(task.layers.start)

    def p_copy(self, task: Task) -> None:
        self.host.p_copy(task.layers.start)


class _Binder:
    """Puts a run's transient tensors into a replica's parameter slots for one call, and the
    placeholders back after it. Cheaper than `torch.func.functional_call` (which rebuilds its
    bookkeeping on every call), and only one compute lane ever calls a given replica."""

    def __init__(self, module: nn.Module) -> None:
        canonical: dict[int, str] = {}
        self.slots: list[tuple[dict[str, Any], str, str, nn.Parameter]] = []
        for name, param in module.named_parameters(remove_duplicate=False):
            first = canonical.setdefault(id(param), name)  # tied slots take the first name's tensor
            owner, _, leaf = name.rpartition(".")
            submodule = module.get_submodule(owner) if owner else module
            self.slots.append((submodule._parameters, leaf, first, param))

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        for slots, leaf, name, _ in self.slots:
            tensor = tensors.get(name)
            if tensor is not None:
                slots[leaf] = tensor

    def unbind(self) -> None:
        for slots, leaf, _, placeholder in self.slots:
            slots[leaf] = placeholder


class _SeededSection:
    def __init__(self, lock: threading.Lock, seed: int) -> None:
        self.lock = lock
        self.seed = seed

    def __enter__(self) -> None:
        self.lock.acquire()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


_HANDLERS: dict[str, Callable[[Runtime, Task], None]] = {
    PARAM_UP: Runtime.param_up,
    ACT_UP: Runtime.act_up,
    COMPUTE: Runtime.compute,
    ACT_DOWN: Runtime.act_down,
    GRAD_DOWN: Runtime.grad_down,
    G_COPY: Runtime.g_copy,
    GRAD_NORM: Runtime.grad_norm,
    STEP: Runtime.step,
    P_COPY: Runtime.p_copy,
}


__all__ = ["IterationData", "LossFn", "Runtime"]
