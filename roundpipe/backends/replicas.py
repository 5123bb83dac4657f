"""Per-device replicas of the model's layers, and the one way a stage calls a layer.

Why apart from the runtime: a layer runs on a device through a structural copy whose parameter
slots are filled, for one call, with the run's transient weights, under a dropout seed that
depends only on (seed, iteration, layer, microbatch), so the forward and its recompute draw the
same masks on any number of devices. The replicas, their binders and the seeding live here; the
runtime's stores and lanes do not. A replica must never keep a finished run's weights alive.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from roundpipe.backends.host_data import ReplicaKey
from roundpipe.backends.out_of_memory import is_out_of_memory
from roundpipe.errors import StageError
from roundpipe.model.attention_residual import ResidualSlot
from roundpipe.sched.task import Task

OutOfMemory = Callable[[Task, str], Exception]  # the error to raise for an OOM inside a layer


class Replicas:
    """The replicas of every layer on every device, and `call`, which runs one of them."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        names: list[str],
        device: Callable[[int], torch.device],
        out_of_memory: OutOfMemory,
        *,
        seed: int,
        prepare: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        self.layers = layers
        self.prepare = prepare  # e.g. compiles a new replica (`roundpipe.backends.compiling`)
        self.names = names
        self.device = device
        self.out_of_memory = out_of_memory
        self.seed = seed
        self._replicas: dict[ReplicaKey, nn.Module] = {}
        self._binders: dict[ReplicaKey, Binder] = {}
        self._replica_lock = threading.Lock()
        self._rng_lock = threading.Lock()
        self.uses_rng = any(
            isinstance(m, nn.Dropout) and m.p > 0 for layer in layers for m in layer.modules()
        ) or any(getattr(getattr(layer, "config", None), "attention_dropout", 0.0) for layer in layers)

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
                if self.prepare is not None:
                    module = self.prepare(module)
                self._binders[key] = Binder(module)
                self._replicas[key] = module
        return module

    def call(
        self,
        task: Task,
        layer: int,
        params: dict[int, dict[str, torch.Tensor]],
        x: Any,
        *,
        output_unread: bool = False,
        residual: ResidualSlot | None = None,
    ) -> Any:
        """Layer ``layer`` of ``task``'s stage on its device, with the run's transient weights.
        ``output_unread``: the caller only back-propagates from the output (a recompute's root),
        so a layer that can skip work for that (``roundpipe_output_unread()``, `frozen_tail`) does.
        ``residual``: the call keeps its post-attention residual there, or uses the one there, where
        the layer can (``roundpipe_residual(slot)``, `attention_residual`)."""
        replica = self.replica(task.device, layer)
        binder = self._binders[ReplicaKey(task.device, layer)]
        skipping: Any = getattr(replica, "roundpipe_output_unread", None) if output_unread else None
        with_residual: Any = getattr(replica, "roundpipe_residual", None) if residual is not None else None
        try:
            with (
                self._rng(task.iteration, layer, task.microbatch),
                skipping() if skipping else nullcontext(),
                with_residual(residual) if with_residual else nullcontext(),
            ):
                binder.bind(params.get(layer, {}))
                binder.forget_cached()
                try:
                    return replica(x)
                finally:
                    binder.unbind()  # the replica must not keep a finished run's weights alive
                    binder.forget_cached()
        except StageError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):  # the allocator's, or one inductor re-raised while compiling
                raise self.out_of_memory(task, f"layer {layer} ({self.names[layer]}), ") from exc
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
        return SeededSection(self._rng_lock, hash((self.seed, iteration, layer, microbatch)) & 0x7FFF_FFFF)


class Binder:
    """Puts a run's transient tensors into a replica's parameter slots for one call, and the
    placeholders back after it. Cheaper than `torch.func.functional_call` (which rebuilds its
    bookkeeping on every call), and only one compute lane ever calls a given replica.

    A layer may re-register a parameter during its call: `torch.nn.utils.parametrize` (which peft's
    ``target_parameters`` LoRA, e.g. on 3-D expert weights, applies for each forward) takes the
    bound tensor out of the slot and, when it removes the parametrization, registers it back as
    a buffer since it is no ``nn.Parameter``. `unbind` drops that buffer and restores the slot.

    peft also computes those weights under `torch.nn.utils.parametrize.cached()`, whose cache is
    one dict for the process, keyed by (id(module), name) and emptied only when the last thread
    inside a ``cached()`` leaves it. With another device's lane inside one, an entry of this
    replica outlived its call, and the next call (the next microbatch, or a backward stage's
    recompute on the replica the forward stage used) read the old weight and its graph: gradients
    went to a finished run's copies, or a backward ran through a freed graph (the expert-LoRA
    parity tests failed about one run in ten on a busy CPU). `forget_cached` drops this replica's
    entries before and after each call."""

    def __init__(self, module: nn.Module) -> None:
        self.module_ids = frozenset(id(m) for m in module.modules())
        canonical: dict[int, str] = {}
        self.slots: list[tuple[dict[str, Any], str, str, nn.Parameter, dict[str, Any]]] = []
        for name, param in module.named_parameters(remove_duplicate=False):
            first = canonical.setdefault(id(param), name)  # tied slots take the first name's tensor
            owner, _, leaf = name.rpartition(".")
            submodule = module.get_submodule(owner) if owner else module
            self.slots.append((submodule._parameters, leaf, first, param, submodule._buffers))

    def bind(self, tensors: dict[str, torch.Tensor]) -> None:
        for slots, leaf, name, _, _ in self.slots:
            tensor = tensors.get(name)
            if tensor is not None:
                slots[leaf] = tensor

    def unbind(self) -> None:
        for slots, leaf, _, placeholder, buffers in self.slots:
            slots[leaf] = placeholder
            if leaf in buffers:  # a bound tensor that a parametrization registered back as a buffer
                del buffers[leaf]

    def forget_cached(self) -> None:
        """Drop the replica's entries from the process-wide parametrization cache (see above)."""
        cache: dict[tuple[int, str], Any] | None = getattr(parametrize, "_cache", None)
        if not cache:
            return
        for key in list(cache):  # one copy under the GIL: other lanes may add entries meanwhile
            if key[0] in self.module_ids:
                cache.pop(key, None)


class SeededSection:
    """Seeds the global generator for one layer call; serialised, as the generator is global."""

    def __init__(self, lock: threading.Lock, seed: int) -> None:
        self.lock = lock
        self.seed = seed

    def __enter__(self) -> None:
        self.lock.acquire()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
