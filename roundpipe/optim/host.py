"""The host copies of the model and the optimizer work on them: G-copy, grad norm, step, P-copy.

Why three copies: devices read a compact *compute copy* (the run's precision, pinned for fast
uploads) while the optimizer updates a full-precision *optimizer copy*; gradients land in fp32
*gradient buffers*, one set per layer, so two layers sharing a parameter (tied embeddings) never
write the same buffer at the same time. The copies are bridged per *unit* (the trainable
parameters one layer owns) by exactly two operations: G-copy (buffers -> optimizer copy's .grad)
and P-copy (optimizer copy -> compute copy). Which of them may run when is decided by the
scheduler's rules, never here.

The user's optimizer is used as it is: the factory is called once per unit, on that unit's fp32
parameters, so each unit can be stepped on its own (shallow units first) without touching torch's
optimizer internals. When a module parameter already is fp32 it *is* the optimizer copy, so the
user's module holds the current weights without any copy back.

This module must never decide ordering or start threads.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.optim.defaults import LossScaler as LossScaler
from roundpipe.optim.defaults import default_optimizer
from roundpipe.optim.defaults import host_adamw as host_adamw
from roundpipe.optim.host_room import Arenas
from roundpipe.optim.lr_ramp import scaled_lr
from roundpipe.optim.prediction import WeightPredictor

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def trainable_units(
    layer_params: Sequence[Sequence[tuple[str, nn.Parameter]]],
) -> tuple[dict[int, int], dict[int, list[nn.Parameter]], list[tuple[int, ...]]]:
    """Per parameter id, the layer that owns it (the shallowest holding it: a tied head's weight
    is the embedding's); per unit (an owning layer), its trainable parameters; per layer, the
    units of its trainable parameters. Pure: `HostModel` and whoever must name the same units
    without building one (bench/async_quality.py) read it."""
    owner_of: dict[int, int] = {}
    for index, named in enumerate(layer_params):
        for _, param in named:
            owner_of.setdefault(id(param), index)
    unit_params: dict[int, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for named in layer_params:
        for _, param in named:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                unit_params.setdefault(owner_of[id(param)], []).append(param)
    owners = [tuple(sorted({owner_of[id(p)] for _, p in named if p.requires_grad})) for named in layer_params]
    return owner_of, unit_params, owners


class HostModel:
    """Host copies of a layer sequence's parameters, per-layer gradient buffers and per-unit
    optimizers. See the module docstring."""

    def __init__(
        self,
        layers: list[nn.Module],
        source: nn.Module,
        *,
        precision: str = "fp32",
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        pin_memory: bool = False,
        weight_prediction: float | tuple[float, ...] = 0.0,
    ) -> None:
        self.layers = layers
        self.source = source
        self.dtype = PRECISION_DTYPES[precision]
        self.pin_memory = pin_memory
        # Named parameters of each layer (names as the layer sees them).
        self.layer_params: list[list[tuple[str, nn.Parameter]]] = [
            list(layer.named_parameters()) for layer in layers
        ]
        self._find_units()
        # The three copies.
        self.master: dict[int, torch.Tensor] = {}
        self.compute: dict[int, torch.Tensor] = {}
        self._make_copies()
        # None means zero: the first gradient to land is adopted, not added, and a G-copy hands
        # the buffer over to the optimizer copy, so no pass over the gradients zeroes anything.
        self.grad_buffers: list[dict[str, torch.Tensor | None]] = [
            {name: None for name, param in named if param.requires_grad} for named in self.layer_params
        ]
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.schedulers: dict[int, Any] = {}
        self._make_optimizers(optimizer or default_optimizer, lr_scheduler)
        self._pinned: dict[torch.Size, list[torch.Tensor]] = {}  # fp32 gradient buffers to reuse
        self._pinned_lock = threading.Lock()
        self.clip_coef = 1.0
        self.found_inf = False
        # Async remedy: deferred P-copies extrapolate by the last updates (optim/prediction.py).
        self.predictor = WeightPredictor(weight_prediction) if weight_prediction else None

    def _find_units(self) -> None:
        """Which layer owns each parameter (the shallowest that holds it), each unit's trainable
        parameters, and where each unit's gradients land."""
        self.owner_of, self.unit_params, self.owners = trainable_units(self.layer_params)
        if not self.unit_params:
            raise ModelError("the model has no trainable parameter (every requires_grad is False)")
        self.units: list[int] = sorted(self.unit_params)
        # Where each unit's gradients land: (layer, name in that layer, parameter), so a G-copy
        # visits its own buffers only instead of scanning every layer.
        self.unit_buffers: dict[int, list[tuple[int, str, nn.Parameter]]] = {u: [] for u in self.units}
        for index, named in enumerate(self.layer_params):
            for name, param in named:
                if param.requires_grad:
                    self.unit_buffers[self.owner_of[id(param)]].append((index, name, param))

    def _make_copies(self) -> None:
        """The fp32 optimizer copy of every trainable parameter and the compute copy of all.

        Frozen parameters never change, so they live on the host once, in the format they travel
        in: the module's own parameter is made to hold its compute copy (a frozen 14B base costs
        its bf16 bytes, not those plus an fp32 original; a 4-bit base its packed bytes). Compute
        copies that must be made are laid out layer by layer in arenas per dtype, pinned when a GPU
        reads them, in few pieces that torch's pinned allocator rounds up little
        (`roundpipe.optim.host_room`, which first checks that the host has room for them)."""
        unique: dict[int, nn.Parameter] = {}
        for named in self.layer_params:
            for _, param in named:
                unique.setdefault(id(param), param)
        made = [p for p in unique.values() if p.requires_grad or not self._usable_as_is(p)]
        arenas = Arenas(made, self.layer_params, self.compute_dtype, self.pin_memory)  # checks the room
        for param in unique.values():
            if param.requires_grad:
                master: torch.Tensor
                if param.dtype == torch.float32 and param.device.type == "cpu":
                    master = param  # the module's own tensor is the fp32 optimizer copy
                else:
                    master = param.detach().to("cpu", torch.float32).clone()
                self.master[id(param)] = master
            if param.requires_grad or not self._usable_as_is(param):
                view = arenas.view(param)
                with torch.no_grad():
                    view.copy_(param.detach())
                self.compute[id(param)] = view
                if not param.requires_grad:
                    param.data = view  # the frozen original is dropped: one host copy
            else:
                self.compute[id(param)] = param.detach()

    def compute_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param`` is held and uploaded in: the run's precision, except integer tensors
        (a quantized base's packed codes and raw scales, always frozen), which stay as they are."""
        return self.dtype if param.is_floating_point() else param.dtype

    def _usable_as_is(self, param: torch.Tensor) -> bool:
        """A frozen tensor that already is a compute copy (right dtype, on the host, pinned if needed)."""
        return (
            param.dtype == self.compute_dtype(param)
            and param.device.type == "cpu"
            and (not self.pin_memory or param.is_pinned())
        )

    def _make_optimizers(self, factory: OptimizerFactory, lr_scheduler: SchedulerFactory | None) -> None:
        """One user optimizer (and scheduler) per unit, on that unit's optimizer copies."""
        for unit in self.units:
            masters = [self.master[id(p)] for p in self.unit_params[unit]]
            opt = factory(masters)
            if not isinstance(opt, torch.optim.Optimizer):
                raise ModelError(
                    f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer; "
                    "pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)"
                )
            self.optimizers[unit] = opt
            if lr_scheduler is not None:
                self.schedulers[unit] = lr_scheduler(opt)

    # ------------------------------------------------------------------ sizes

    def param_bytes(self, trainable: bool = False) -> tuple[int, ...]:
        """Per layer, the bytes of its compute copies (``trainable``: of the trainable ones only,
        which are also the bytes of its gradients)."""
        return tuple(
            sum(self.compute[id(p)].nbytes for _, p in named if p.requires_grad or not trainable)
            for named in self.layer_params
        )

    def layer_numel(self) -> tuple[int, ...]:
        return tuple(sum(p.numel() for _, p in named) for named in self.layer_params)

    def trainable_numel(self) -> int:
        return sum(p.numel() for params in self.unit_params.values() for p in params)

    # ------------------------------------------------------------------ the four optimizer-lane operations

    @torch.no_grad()
    def land_gradient(self, layer: int, name: str, grad: torch.Tensor) -> None:
        """A gradient download: add ``grad`` (any device/dtype) into the layer's fp32 buffer."""
        buffers = self.grad_buffers[layer]
        current = buffers[name]
        if grad.device.type != "cpu":
            # Convert on the device, then copy into a recycled pinned fp32 buffer: a fresh pageable
            # buffer page-faults its way through the copy, and converting on the host is slower
            # than the download itself (docs/performance.md).
            buf = self.take_pinned(grad.shape)
            buf.copy_(grad.to(torch.float32))
            if current is None:
                buffers[name] = buf  # recycled once the optimizer step has used it
            else:
                current.add_(buf)
                self._give_pinned(buf)
            return
        host = grad.to(torch.float32)
        if current is None:
            # Adopt it: the transient copy that produced it is dropped after its download.
            buffers[name] = host
        else:
            current.add_(host)
            if host.is_pinned():  # a landing buffer of a GPU download: reuse it
                self._give_pinned(host)

    def take_pinned(self, shape: torch.Size) -> torch.Tensor:
        """A pinned fp32 buffer of ``shape`` for a gradient download to land in (recycled)."""
        with self._pinned_lock:
            free = self._pinned.get(shape)
            if free:
                return free.pop()
        return torch.empty(shape, dtype=torch.float32, pin_memory=True)

    def _give_pinned(self, tensor: torch.Tensor) -> None:
        with self._pinned_lock:
            self._pinned.setdefault(tensor.shape, []).append(tensor)

    @torch.no_grad()
    def g_copy(self, unit: int, scale: float = 1.0) -> None:
        """Move every gradient buffer of ``unit``'s parameters into the fp32 ``.grad`` (summing
        buffers of layers that share a parameter) and leave the buffers empty."""
        inv = 1.0 / scale
        for index, name, param in self.unit_buffers[unit]:
            buffers = self.grad_buffers[index]
            buf = buffers[name]
            if buf is None:
                continue
            buffers[name] = None
            master = self.master[id(param)]
            if master.grad is None:
                master.grad = buf.mul_(inv) if inv != 1.0 else buf
            else:
                master.grad.add_(buf, alpha=inv)
                if buf.is_pinned():
                    self._give_pinned(buf)

    @torch.no_grad()
    def grad_norm(self, max_norm: float | None, check_finite: bool) -> float:
        """Global gradient norm over all units: sets ``clip_coef`` and ``found_inf``; returns it."""
        total = 0.0
        for unit in self.units:
            for param in self.unit_params[unit]:
                grad = self.master[id(param)].grad
                if grad is not None:
                    total += float(torch.linalg.vector_norm(grad, 2.0)) ** 2
        norm = math.sqrt(total)
        self.found_inf = check_finite and not math.isfinite(norm)
        if max_norm is not None and math.isfinite(norm):
            self.clip_coef = min(1.0, max_norm / (norm + 1e-6))
        else:
            self.clip_coef = 1.0
        return norm

    @torch.no_grad()
    def step(self, unit: int, *, remember: bool = False, lr_scale: float = 1.0) -> None:
        """Step ``unit``'s optimizer (at ``lr_scale`` times its lr: the async lr ramp);
        ``remember``: first keep the weights it starts from, for the predicting P-copy after it."""
        opt = self.optimizers[unit]
        masters = [self.master[id(p)] for p in self.unit_params[unit]]
        if remember and self.predictor is not None:
            for param in self.unit_params[unit]:
                self.predictor.remember(id(param), self.master[id(param)], skipped=self.found_inf)
        if not self.found_inf:
            if self.clip_coef < 1.0:
                for master in masters:
                    if master.grad is not None:
                        master.grad.mul_(self.clip_coef)
            with scaled_lr(opt, lr_scale):
                opt.step()
            scheduler = self.schedulers.get(unit)
            if scheduler is not None:
                scheduler.step()
        for master in masters:
            grad = master.grad
            if grad is not None and grad.is_pinned():
                self._give_pinned(grad)  # a gradient that came from a GPU: reuse its buffer
            master.grad = None

    @torch.no_grad()
    def p_copy(self, unit: int, *, predict: bool = False) -> None:
        """Optimizer copy -> compute copy; ``predict``: extrapolated by the last update."""
        predictor = self.predictor if predict else None
        for param in self.unit_params[unit]:
            if predictor is not None:
                predictor.predict_into(id(param), self.compute[id(param)], self.master[id(param)])
            else:
                self.compute[id(param)].copy_(self.master[id(param)])

    def p_copy_all(self) -> None:
        for unit in self.units:
            self.p_copy(unit)

    def drop_gradients(self) -> None:
        """Forget every gradient not yet stepped: the landed buffers and the optimizer copy's
        ``.grad`` (after a failed iteration, or when a saved state replaces this one)."""
        for buffers in self.grad_buffers:
            for name in buffers:
                buffers[name] = None
        for masters in self.unit_params.values():
            for param in masters:
                self.master[id(param)].grad = None

    @torch.no_grad()
    def sync_module(self) -> None:
        """Write the optimizer copy into module parameters that are not themselves the copy."""
        for unit in self.units:
            for param in self.unit_params[unit]:
                master = self.master[id(param)]
                if master is not param:
                    param.copy_(master)

    # ------------------------------------------------------------------ state

    def named_masters(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
        """(source name, module parameter, optimizer copy) for every trainable parameter."""
        for name, param in self.source.named_parameters():
            if id(param) in self.master:
                yield name, param, self.master[id(param)]

    def named_compute(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.source.named_parameters():
            if id(param) in self.master:
                yield name, self.compute[id(param)]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "optimizers": {unit: opt.state_dict() for unit, opt in self.optimizers.items()},
            "schedulers": {unit: s.state_dict() for unit, s in self.schedulers.items()},
        }
        if self.predictor is not None:
            names = {id(param): name for name, param, _ in self.named_masters()}
            state["previous_weights"] = self.predictor.state_dict(names)
            if len(self.predictor.factors) > 1:
                state["earlier_weights"] = self.predictor.earlier_state_dict(names)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["optimizers"]) != set(self.optimizers):
            raise ModelError(
                f"optimizer state has units {sorted(state['optimizers'])} but this model has {self.units}; "
                "was it saved from a different model?"
            )
        for unit, opt_state in state["optimizers"].items():
            self.optimizers[unit].load_state_dict(opt_state)
        for unit, sched_state in state.get("schedulers", {}).items():
            if unit in self.schedulers:
                self.schedulers[unit].load_state_dict(sched_state)
        if self.predictor is not None:
            keys = {name: id(param) for name, param, _ in self.named_masters()}
            self.predictor.load_state_dict(
                state.get("previous_weights", {}), keys, state.get("earlier_weights")
            )
