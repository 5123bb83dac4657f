"""The math of each stage kind over one microbatch: forward, fused, recompute, backward.

Why apart from the runtime: the runtime moves tensors between the host, the lanes and its stores;
what a stage computes is written here once, as functions of the runtime's layer call
(`LayerCall`: one layer of the plan on the task's device, with its transient weights bound and its
dropout seeded). A backward stage is two tasks: `recompute_stage` runs the forward again from the
saved activation and returns what the backward needs (`Recomputed`: stage grain keeps the autograd
graph's outputs and input leaves, layer grain the input of every layer), and `backward_stage`
back-propagates the incoming gradient through it. Together they do exactly what one task did
before the split, so the numbers are the same.

Functions here must never touch the runtime's stores or decide when anything runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from roundpipe.backends.host_data import IterationData
from roundpipe.backends.out_of_memory import is_out_of_memory
from roundpipe.backends.tensors import cast_floating, differentiable_leaves, to_device, with_leaves
from roundpipe.errors import StageError
from roundpipe.model.attention_residual import ResidualSlot
from roundpipe.sched.task import Task

Params = dict[int, dict[str, torch.Tensor]]  # layer -> name -> the run's transient tensor


class LayerCall(Protocol):
    def __call__(
        self,
        task: Task,
        layer: int,
        params: Params,
        x: Any,
        *,
        output_unread: bool = False,
        residual: ResidualSlot | None = None,
    ) -> Any: ...


class ResidualOf(NamedTuple):
    """A forward stage's output key for the post-attention residual of ``layer``'s call, sent down
    beside that layer's saved input (`roundpipe.model.attention_residual`)."""

    layer: int


@dataclass
class Recomputed:
    """What a backward stage's recompute leaves on the device for its backward."""

    outputs: list[torch.Tensor | None] = field(default_factory=list)  # stage grain: the graph's outputs
    leaves: list[torch.Tensor | None] = field(default_factory=list)  # stage grain: its input leaves
    inputs: list[Any] | None = None  # layer grain: the input of every layer, computed without grad
    # layer_input grain: every layer's graph outputs and input leaves, from its own saved input
    layers: list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]] | None = None
    # The activation as uploaded, constants included (rotary tables, labels): on CUDA another stream
    # allocated it, and the backward's kernels still read what the graph saved of it after
    # autograd has let go of it (`Runtime.recompute`).
    uploaded: Any = None


def forward_stage(
    call: LayerCall,
    data: IterationData,
    task: Task,
    params: Params,
    x: Any,
    record: Callable[[int, float], None] | None,
) -> dict[int | ResidualOf, Any]:
    """Run a forward stage without grad; returns the activations to send down by layer (the
    output, and the input of every layer inside the stage where a backward stage starts), and by
    `ResidualOf` the residuals the layers of ``data.residuals`` kept.
    ``record(layer, ms)``, when given, receives each layer's wall time (host-synchronous devices)."""
    saved: dict[int | ResidualOf, Any] = {}
    with torch.no_grad():
        for layer in task.layers:
            if layer != task.layers.start and layer in data.boundaries:
                saved[layer] = x
            slot = ResidualSlot() if layer in data.residuals else None
            started = time.perf_counter()
            x = call(task, layer, params, x, residual=slot)
            if slot is not None and slot.value is not None:
                saved[ResidualOf(layer)] = slot.value
            if record is not None:
                record(layer, (time.perf_counter() - started) * 1e3)
    saved[task.layers.stop] = x
    return saved


def fused_stage(
    call: LayerCall,
    data: IterationData,
    task: Task,
    params: Params,
    x: Any,
    *,
    computes_loss: bool,
    device: torch.device,
) -> dict[int, Any]:
    """Forward, loss and backward at once; returns the input gradient by layer."""
    start = task.layers.start
    x, leaves = with_leaves(x) if start > 0 else (x, [])
    with torch.enable_grad():
        out = x
        for layer in task.layers:
            out = call(task, layer, params, out)
        loss = out if computes_loss or data.loss_fn is None else _loss(data, task, out, device)
        _check_scalar(task, loss)
        scaled = loss.reshape(()) * (data.weights[task.microbatch] * data.loss_scale)
        _backward(task, scaled.backward)
    data.losses[task.microbatch] = loss.detach()  # no host sync here: read once the task is done
    return {start: [leaf.grad if leaf is not None else None for leaf in leaves]}


def _loss(data: IterationData, task: Task, out: Any, device: torch.device) -> Any:
    mb = task.microbatch
    assert data.loss_fn is not None
    target = to_device(data.targets[mb], device)
    try:
        # The loss is computed in fp32 whatever the compute precision.
        return data.loss_fn(cast_floating(out, torch.float32), target)
    except Exception as exc:
        raise StageError(
            f"loss_fn raised {type(exc).__name__}: {exc} (stage {task.stage} on device "
            f"{task.device}, microbatch {mb}, iteration {task.iteration})",
            task.describe(),
        ) from exc


def _check_scalar(task: Task, loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
        raise StageError(
            f"the loss must be a scalar tensor, got {what} (stage {task.stage}, microbatch {task.microbatch}); "
            "pass a loss_fn(output, target) that returns a scalar, or a model whose last layer does",
            task.describe(),
        )


def recompute_stage(
    call: LayerCall, task: Task, params: Params, act: Any, *, grain: str, skip_tail: bool = True
) -> Recomputed:
    """A backward stage's forward again from its saved activation (see `Recomputed`); with
    ``grain="layer_input"``, ``act`` is every layer's (input, residual or None) and each layer
    runs from its own, given its residual (`roundpipe.model.attention_residual`). With
    ``skip_tail``, a layer whose output is only the backward's root is told so
    (`roundpipe.model.frozen_tail`): the gradients are the same, for less work."""
    if grain == "layer_input":
        layers = []
        with torch.enable_grad():
            for layer, (layer_input, residual) in zip(task.layers, act, strict=True):
                x, leaves = with_leaves(layer_input) if layer > 0 else (layer_input, [])
                slot = ResidualSlot(residual) if residual is not None and skip_tail else None
                out = call(task, layer, params, x, output_unread=skip_tail, residual=slot)
                layers.append((differentiable_leaves(out), leaves))
        return Recomputed(layers=layers)
    if grain == "layer" and len(task.layers) > 1:
        # Only the layers' inputs are kept: the last layer's output would be read by nothing (its
        # backward recomputes it with gradients), so the pass stops before that layer.
        inputs = [act]
        with torch.no_grad():
            for layer in task.layers[:-1]:
                inputs.append(call(task, layer, params, inputs[-1]))
        return Recomputed(inputs=inputs)
    x, leaves = with_leaves(act) if task.layers.start > 0 else (act, [])
    last = task.layers.stop - 1
    with torch.enable_grad():
        out = x
        for layer in task.layers:
            out = call(task, layer, params, out, output_unread=skip_tail and layer == last)
    return Recomputed(differentiable_leaves(out), leaves)


def backward_stage(
    call: LayerCall,
    task: Task,
    params: Params,
    state: Recomputed,
    grad_out: list[Any],
    *,
    skip_tail: bool = True,
) -> dict[int, Any]:
    """Back-propagate ``grad_out`` through a recomputed backward stage; returns the input
    gradient by layer (stage grain through the kept graph, layer_input grain through each layer's,
    deepest first; layer grain recomputes each layer deepest first, its output only a root there,
    as ``skip_tail`` in `recompute_stage`)."""
    start, grads = task.layers.start, grad_out
    if state.layers is not None:
        for outputs, layer_leaves in reversed(state.layers):
            grads = _propagate(task, outputs, layer_leaves, grads)
        return {start: grads}
    if state.inputs is None:
        return {start: _propagate(task, state.outputs, state.leaves, grad_out)}
    for layer, layer_input in zip(reversed(task.layers), reversed(state.inputs), strict=True):
        x, leaves = with_leaves(layer_input) if layer > 0 else (layer_input, [])
        with torch.enable_grad():
            out = call(task, layer, params, x, output_unread=skip_tail)
        grads = _propagate(task, differentiable_leaves(out), leaves, grads)
    return {start: grads}


def _propagate(
    task: Task, outputs: list[torch.Tensor | None], leaves: list[torch.Tensor | None], grad_out: list[Any]
) -> list[torch.Tensor | None]:
    with torch.enable_grad():
        pairs = [
            (o, g.to(o.device, o.dtype))
            for o, g in zip(outputs, grad_out, strict=False)
            if o is not None and g is not None and o.requires_grad
        ]
        if pairs:
            _backward(task, lambda: torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs]))
    return [leaf.grad if leaf is not None else None for leaf in leaves]


def _backward(task: Task, run: Callable[[], None]) -> None:
    """Run a stage's backward; what a layer's backward raises becomes a `StageError` naming the
    stage (out-of-memory is left to the runtime, which names the prediction)."""
    try:
        run()
    except StageError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise
        first, last = task.layers.start, task.layers.stop - 1
        raise StageError(
            f"the backward of stage {task.stage} (layers {first}-{last}) raised {type(exc).__name__}: "
            f"{exc} (device {task.device}, microbatch {task.microbatch}, iteration {task.iteration})",
            task.describe(),
        ) from exc
