"""Which storages an activation, or autograd's saved tensors, occupy on a device.

Why apart from the profile: a layer's memory is counted in distinct storages (a view keeps its
whole storage, and carried constants are shared by every activation that refers to them), and
saved tensors are seen through autograd's pack hook; the profile only combines these counts.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def collect_storages(
    obj: Any, out: dict[int, int], constant: bool = False, only_constants: bool = False
) -> None:
    """Distinct storages of an activation (data pointer -> bytes); with ``only_constants`` only
    those under dict keys starting with "_" (carried constants)."""
    if isinstance(obj, torch.Tensor):
        if constant or not only_constants:
            out[storage_key(obj)] = storage_bytes(obj)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            is_const = constant or (isinstance(key, str) and key.startswith("_"))
            collect_storages(value, out, is_const, only_constants)
    elif isinstance(obj, tuple | list):
        for value in obj:
            collect_storages(value, out, constant, only_constants)


def storage_key(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. wrapped subclasses)
        return id(t)


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def activation_bytes(obj: Any) -> tuple[int, int]:
    """(all bytes, carried-constant bytes) of an activation's distinct storages."""
    every: dict[int, int] = {}
    constants: dict[int, int] = {}
    collect_storages(obj, every)
    collect_storages(obj, constants, only_constants=True)
    return sum(every.values()), sum(constants.values())


def record_moved(task: Any, value: Any) -> None:
    """Give a transfer task whose graph left its bytes unknown (a real run's activations: the
    graph's ``act_bytes`` is a cost model's) the bytes it moves, so a trace counts what crossed
    the link: every tensor of ``value``, as the copy moves each one (a constant that several layer
    inputs share crosses once per input), in one pass over the structure."""
    if not task.nbytes:
        task.nbytes = sum(
            t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor)
        )


@contextmanager
def recording_saved(
    exclude: set[int], param_shaped: dict[torch.Size, list[weakref.ref[torch.UntypedStorage]]] | None = None
) -> Iterator[dict[int, int]]:
    """Every storage autograd saves inside the block (data pointer -> bytes), minus ``exclude``.
    The storages of saved tensors shaped like a parameter (keys of ``param_shaped``) are also noted
    there, by weak reference: one that becomes the parameter's gradient (computed ahead in the
    forward) is then that very storage after the backward, which a freed tensor's reused address
    cannot imitate, and a strong reference would change (autograd copies a gradient that is
    referenced elsewhere)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in exclude:
            saved[key] = storage_bytes(t)
            if param_shaped is not None and t.shape in param_shaped:
                param_shaped[t.shape].append(weakref.ref(t.untyped_storage()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
