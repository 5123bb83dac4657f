"""Measure what each layer costs on the device, and set a device's memory budget.

The planner needs per-layer facts it cannot guess: forward and backward times and, for one
microbatch, the bytes autograd saves, the transient working set and the activations crossing each
layer boundary (`roundpipe.plan.memory.LayerMemory`). `profile_layers` runs every layer once, in
order, on one real microbatch, on the device that will run it, with a device copy of that layer's
parameters only (so a model that does not fit the device can still be profiled), and frees each
copy before the next layer.

What is measured and how:
- saved bytes, on any device: `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd
  saves; the distinct storages (a view keeps its whole storage) that are not the layer's parameters
  or buffers are summed. On CUDA the allocator's view (bytes still allocated after the forward
  with grad, less the new output, plus saved inputs) is a cross-check that also sees tensors a
  custom autograd function keeps outside ``save_for_backward``; the larger of the two is used;
- working sets, on CUDA only: ``max_memory_allocated`` above what was allocated before the forward
  without grad (less the new output) or, when larger, above what the forward with grad leaves
  allocated (this sees a ``loss_fn``'s transients); and above what was allocated before the
  backward (less the parameter gradients). On CPU there is no allocator to ask: the working sets are reported as 0;
- times: wall clock around each phase (CUDA synchronised), the forward without grad and the
  backward without recompute, as `roundpipe.plan.LayerCosts` expects. One untimed forward and
  backward runs first for each kind of layer (class, parameter shapes, attention variant, input
  sizes: a model's decoder layers are one or two kinds), so one-time initialisation (cuBLAS
  handles, workspaces, compiled graphs, autograd's threads) is neither timed nor counted.

It must never keep a device copy after it returns, change the user's parameters, or schedule work.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.backends.meter import Meter as _Meter
from roundpipe.backends.out_of_memory import is_out_of_memory
from roundpipe.backends.profile_bytes import (
    ShapedRefs,
    allocated_for_backward,
    dequantized_bytes,
    gradients_saved_ahead,
)
from roundpipe.backends.profile_kinds import OnePerKind, warm_up_kind
from roundpipe.backends.replicas import Binder
from roundpipe.backends.storages import (
    activation_bytes,
    collect_storages,
    recording_saved,
    storage_bytes,
    storage_key,
)
from roundpipe.backends.tensors import cast_floating, differentiable_leaves, to_device, with_leaves
from roundpipe.errors import DeviceOutOfMemoryError, StageError
from roundpipe.model.attention_residual import ResidualSlot
from roundpipe.plan.memory import LayerMemory
from roundpipe.plan.sizes import format_bytes

GiB = 2**30
Prepare = Callable[[nn.Module], nn.Module]  # readies a layer copy as the run's replicas (compiled or not)


# --------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class LayerMeasurement:
    """Everything measured for one layer on one microbatch (bytes; milliseconds)."""

    index: int
    name: str
    fwd_ms: float
    fwd_grad_ms: float
    bwd_ms: float
    param_bytes: int
    grad_bytes: int
    saved_bytes: int
    saved_hook_bytes: int
    saved_alloc_bytes: int | None
    work_bytes: int
    bwd_work_bytes: int
    boundary_bytes: int
    saved_grad_bytes: int
    carried_bytes: int
    residual_bytes: int = 0


def _device_copy(
    layer: nn.Module, device: torch.device, dtype: torch.dtype | None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A structural copy of ``layer`` on ``device`` (buffers moved, parameters left as empty
    placeholders) and device copies of its parameters in the compute precision."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
        for p in layer.parameters()
    }
    replica = copy.deepcopy(layer, memo).to(device)
    params = {}
    for name, p in layer.named_parameters():
        target = dtype if dtype is not None and p.is_floating_point() else p.dtype
        params[name] = p.detach().to(device, target).requires_grad_(p.requires_grad)
    return replica, params


def _scalar_loss(out: Any) -> torch.Tensor | None:
    return out if isinstance(out, torch.Tensor) and out.numel() == 1 and out.requires_grad else None


def _backward(meter: _Meter, out: Any) -> dict[str, float]:
    """Backpropagate a loss, or ones into every differentiable output; measure it."""
    loss = _scalar_loss(out)
    outputs = [] if loss is not None else [o for o in differentiable_leaves(out) if o is not None]
    outputs = [o for o in outputs if o.requires_grad]
    grads = [torch.ones_like(o) for o in outputs]
    with meter.phase() as phase:
        if loss is not None:
            loss.backward()
        elif outputs:
            torch.autograd.backward(outputs, grads)
    return phase


def _warm_up(
    call: Callable[[Any], Any], x: Any, index: int, params: dict[str, torch.Tensor], loss: Any
) -> None:
    """Untimed calls first: one-time initialisation (cuBLAS handles, workspaces, compiling a
    compiled layer's graphs) is neither timed nor counted. With grad only where the layer has
    something to differentiate, and its gradients are dropped again."""
    with torch.no_grad():
        call(x)
    if not any(p.requires_grad for p in params.values()) and index == 0:
        return
    leaf_x, _ = with_leaves(x) if index > 0 else (x, [])
    with torch.enable_grad():
        out = call(leaf_x)
        out = loss(out) if loss is not None else out
    first = _scalar_loss(out)
    outputs = [o for o in differentiable_leaves(out) if o is not None and o.requires_grad]
    if first is not None:
        first.backward()
    elif outputs:
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    for p in params.values():
        p.grad = None


def _bound_call(
    replica: nn.Module, params: dict[str, torch.Tensor], keep_residual: bool = False
) -> tuple[Callable[[Any], Any], list[int]]:
    """Call ``replica`` as the runtime calls a layer: its parameter slots bound for the call, and
    without grad to copies that require none, as a forward stage binds them (a compiled layer
    guards on each parameter's ``requires_grad``: bound as they are, the profile's calls without
    grad compiled variants no stage runs). With ``keep_residual``, a call without grad keeps the
    layer's post-attention residual as a forward stage that saves them does
    (`roundpipe.model.attention_residual`); the list returned then holds its bytes."""
    binder = Binder(replica)
    detached = {name: p.detach() for name, p in params.items()}
    keeping: Any = getattr(replica, "roundpipe_residual", None) if keep_residual else None
    kept: list[int] = []

    def call(inp: Any) -> Any:
        grad = torch.is_grad_enabled()
        binder.bind(params if grad else detached)
        slot = ResidualSlot() if keeping is not None and not grad else None
        try:
            with keeping(slot) if slot is not None else nullcontext():
                return replica(inp)
        finally:
            binder.unbind()
            if slot is not None:
                kept[:] = [storage_bytes(slot.value) if slot.value is not None else 0]

    return call, kept


def _measure_layer(
    index: int,
    name: str,
    layer: nn.Module,
    x: Any,
    meter: _Meter,
    dtype: torch.dtype | None,
    loss: Callable[[Any], Any] | None,
    prepare: Prepare | None = None,
    warmed: set[tuple[Any, ...]] | None = None,
    keep_residual: bool = False,
) -> tuple[LayerMeasurement, Any]:
    """Measure one layer on input ``x``; returns the measurement and the layer's output (no grad).
    ``warmed``: the kinds of layer already warmed up (`profile_kinds.warm_up_kind`); this one's is
    added. ``keep_residual``: its calls without grad keep the residual (`_bound_call`)."""
    replica, params = _device_copy(layer, meter.device, dtype)
    replica = prepare(replica) if prepare is not None else replica
    own = {storage_key(t) for t in [*params.values(), *replica.buffers()]}
    call, residual = _bound_call(replica, params, keep_residual)
    boundary, carried = activation_bytes(x)
    inputs: dict[int, int] = {}
    collect_storages(x, inputs)
    _warm_up_once(layer, call, x, index, params, loss, warmed)
    y, fwd, work = _forward_no_grad(call, x, meter, inputs)
    leaf_x, _ = with_leaves(x) if index > 0 else (x, [])
    param_shaped: ShapedRefs = {p.shape: [] for p in params.values() if p.dim()}
    with recording_saved(own, param_shaped) as saved, torch.enable_grad(), meter.phase() as grad_fwd:
        out = call(leaf_x)
        out = loss(out) if loss is not None else out
    hooks = sum(saved.values())
    alloc: int | None = None
    if meter.cuda:
        alloc = allocated_for_backward(out, inputs, saved, grad_fwd)
        work = max(work, int(grad_fwd["peak"] - grad_fwd["after"]))  # e.g. a user loss_fn's transients
    grad_bytes = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
    bwd = _backward(meter, out)
    saved_grad = gradients_saved_ahead(params, param_shaped)
    fresh = grad_bytes - saved_grad
    bwd_work = max(0, int(bwd["peak"] - bwd["before"]) - fresh) if meter.cuda else 0
    dense = dequantized_bytes(layer, dtype)
    work, bwd_work = max(work, dense), max(bwd_work, dense)
    measurement = LayerMeasurement(
        index=index,
        name=name,
        fwd_ms=fwd["ms"],
        fwd_grad_ms=grad_fwd["ms"],
        bwd_ms=bwd["ms"],
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        grad_bytes=grad_bytes,
        saved_bytes=max(hooks, alloc or 0),
        saved_hook_bytes=hooks,
        saved_alloc_bytes=alloc,
        work_bytes=work,
        bwd_work_bytes=bwd_work,
        boundary_bytes=boundary,
        carried_bytes=carried,
        saved_grad_bytes=min(saved_grad, max(hooks, alloc or 0)),
        residual_bytes=residual[0] if residual else 0,
    )
    return measurement, y


def _warm_up_once(
    layer: nn.Module,
    call: Callable[[Any], Any],
    x: Any,
    index: int,
    params: dict[str, torch.Tensor],
    loss: Callable[[Any], Any] | None,
    warmed: set[tuple[Any, ...]] | None,
) -> None:
    """`_warm_up` unless a layer of this kind (`profile_kinds.warm_up_kind`) was warmed up already."""
    kind = warm_up_kind(layer, x, loss is not None)
    if warmed is None or kind not in warmed:
        _warm_up(call, x, index, params, loss)
        if warmed is not None:
            warmed.add(kind)


def _forward_no_grad(
    call: Callable[[Any], Any], x: Any, meter: _Meter, inputs: dict[int, int]
) -> tuple[Any, dict[str, float], int]:
    """The timed forward without grad: its output, the phase's figures, and its working memory
    beyond the output storages not among the ``inputs`` (0 off CUDA)."""
    with torch.no_grad(), meter.phase() as fwd:
        y = call(x)
    outputs: dict[int, int] = {}
    collect_storages(y, outputs)
    new_out = sum(b for k, b in outputs.items() if k not in inputs)
    work = max(0, int(fwd["peak"] - fwd["before"]) - new_out) if meter.cuda else 0
    return y, fwd, work


# --------------------------------------------------------------------- all layers


def _own_rng(device: torch.device) -> Any:
    """Restore the CPU (and this CUDA device's) random state afterwards."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(
        devices=[torch.cuda.current_device() if device.index is None else device.index]
    )


def measure_layers(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    computes_loss: bool,
    dtype: torch.dtype | None = None,
    names: Sequence[str] | None = None,
    prepare: Prepare | None = None,
    one_per_kind: bool = False,
    keep_residuals: bool = False,
) -> list[LayerMeasurement]:
    """Run each layer once, in order, on ``sample`` (one microbatch: layer 0's input) and measure it.

    ``dtype`` is the compute precision (floating parameters and inputs are cast to it; None keeps
    theirs). The last layer's backward starts from its loss: its own (``computes_loss``) or
    ``loss_fn(output in fp32, target)``; without either, from ones for each floating output.
    ``one_per_kind``: a layer of a kind already measured takes its figures (`profile_kinds`);
    ``keep_residuals``: calls without grad keep the residuals a run saves (`_bound_call`)."""
    device = torch.device(device)
    meter = _Meter(device)
    labels = list(names) if names is not None else [str(i) for i in range(len(layers))]
    x = to_device(cast_floating(sample, dtype) if dtype is not None else sample, device)
    tail: Callable[[Any], Any] | None = None
    if loss_fn is not None and not computes_loss:
        target_on_device = to_device(target, device)
        tail = lambda out: loss_fn(cast_floating(out, torch.float32), target_on_device)  # noqa: E731
    # The first backward starts autograd's device threads (a second on CPU): not a layer's cost.
    torch.ones(1, device=device, requires_grad=True).sum().backward()
    out: list[LayerMeasurement] = []
    warmed: set[tuple[Any, ...]] = set()
    kinds: OnePerKind[LayerMeasurement] = OnePerKind(one_per_kind)
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        if (reused := kinds.reuse(layer, x, last, i, labels[i])) is not None:
            out.append(reused)
            continue
        try:
            with _own_rng(device):  # dropout here must not shift the user's random stream
                loss = tail if last else None
                measurement, x = _measure_layer(
                    i, labels[i], layer, x, meter, dtype, loss, prepare, warmed, keep_residuals
                )
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise StageError(
                    f"layer {i} ({labels[i]!r}) raised {type(exc).__name__} while being profiled on {device}: {exc}",
                    f"profile layer {i}",
                ) from exc
            raise DeviceOutOfMemoryError(
                f"out of memory profiling layer {i} ({labels[i]!r}) on {device} for one microbatch "
                f"({format_bytes(activation_bytes(x)[0])} of input): the layer alone does not fit; use "
                "more microbatches (fewer tokens each) or a shorter sequence",
                f"profile layer {i}",
            ) from exc
        out.append(measurement)
        kinds.measured(measurement, x)
    return out


def profile_layers(
    layers: Sequence[nn.Module],
    sample: Any,
    device: torch.device,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    computes_loss: bool,
    dtype: torch.dtype | None = None,
    names: Sequence[str] | None = None,
    prepare: Prepare | None = None,
    one_per_kind: bool = False,
    keep_residuals: bool = False,
) -> tuple[LayerMemory, tuple[float, ...], tuple[float, ...]]:
    """The planner's inputs from `measure_layers`: memory facts, forward ms, backward ms per layer."""
    ms = measure_layers(
        layers,
        sample,
        device,
        loss_fn=loss_fn,
        target=target,
        computes_loss=computes_loss,
        dtype=dtype,
        names=names,
        prepare=prepare,
        one_per_kind=one_per_kind,
        keep_residuals=keep_residuals,
    )
    memory = LayerMemory(
        param_bytes=tuple(m.param_bytes for m in ms),
        grad_bytes=tuple(m.grad_bytes for m in ms),
        saved_bytes=tuple(m.saved_bytes for m in ms),
        work_bytes=tuple(m.work_bytes for m in ms),
        boundary_bytes=tuple(m.boundary_bytes for m in ms),
        bwd_work_bytes=tuple(m.bwd_work_bytes for m in ms),
        carried_bytes=tuple(m.carried_bytes for m in ms),
        names=tuple(m.name for m in ms),
        saved_grad_bytes=tuple(m.saved_grad_bytes for m in ms),
        residual_bytes=tuple(m.residual_bytes for m in ms),
    )
    return memory, tuple(m.fwd_ms for m in ms), tuple(m.bwd_ms for m in ms)
