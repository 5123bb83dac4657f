"""Tensor plumbing shared by the real backends: activation structures and transient storage.

An activation is a tensor or a (nested) dict / tuple / list of tensors. The rules of what is
differentiable live here, once: floating-point tensors are, integer/bool tensors are not, and
dict entries whose key starts with "_" are constants (carried, never differentiated). So does
the pool that lets a backend reuse the storage of finished stages' transient weights.

Nothing here knows about tasks, stages or scheduling.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# --------------------------------------------------------------------- activation helpers


def _differentiable(obj: Any, out: list[torch.Tensor | None]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj if obj.is_floating_point() else None)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if not (isinstance(key, str) and key.startswith("_")):
                _differentiable(value, out)
    elif isinstance(obj, tuple | list):
        for value in obj:
            _differentiable(value, out)


def differentiable_leaves(obj: Any) -> list[torch.Tensor | None]:
    """The differentiable tensors of an activation, in a fixed traversal order (None for the
    positions of integer tensors, so two traversals of the same structure line up)."""
    out: list[torch.Tensor | None] = []
    _differentiable(obj, out)
    return out


def with_leaves(obj: Any) -> tuple[Any, list[torch.Tensor | None]]:
    """A copy of the activation whose differentiable tensors are fresh leaves requiring grad."""
    leaves: list[torch.Tensor | None] = []
    return _rebuild(obj, False, leaves), leaves


def _rebuild(value: Any, constant: bool, leaves: list[torch.Tensor | None]) -> Any:
    # A module function, not a closure that calls itself: such a closure is a reference cycle that
    # kept every stage input and its gradient on the device until a full garbage collection.
    if isinstance(value, torch.Tensor):
        if constant:
            return value
        if value.is_floating_point():
            leaf = value.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        leaves.append(None)
        return value
    if isinstance(value, Mapping):
        return {
            k: _rebuild(v, constant or (isinstance(k, str) and k.startswith("_")), leaves)
            for k, v in value.items()
        }
    if isinstance(value, tuple | list):
        return type(value)(_rebuild(v, constant, leaves) for v in value)
    return value


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj


def download(obj: Any) -> Any:
    """A device activation copied to the host. From a GPU the copy lands in pinned memory and is
    asynchronous (on the current stream): the host must not read it before that stream's work
    has completed, but device consumers ordered after it may upload it at once."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj
        out = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        out.copy_(obj, non_blocking=True)
        return out
    if isinstance(obj, Mapping):
        return {k: download(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(download(v) for v in obj)
    return obj


GRADIENT_CHUNK_BYTES = 64 << 20
"""The most fp32 bytes a gradient converts on the device at once (`download_fp32`): a transient the
memory model leaves out, so it stays this small whatever size ``RunConfig.chunk_bytes`` uploads the
weights in."""


def gradient_chunk_elements(chunk_bytes: int | None) -> int:
    """fp32 elements per gradient chunk: ``chunk_bytes`` (None: no split) up to `GRADIENT_CHUNK_BYTES`."""
    return max(1, min(chunk_bytes or GRADIENT_CHUNK_BYTES, GRADIENT_CHUNK_BYTES) // 4)


def download_fp32(source: torch.Tensor, landing: torch.Tensor, chunk_elements: int) -> None:
    """Copy a device tensor into the host fp32 tensor ``landing``, converting on the device one
    chunk at a time (a 600 MB bf16 LM-head gradient never needs 2.4 GB of fp32 on the device)."""
    flat_source = source.reshape(-1)
    flat_landing = landing.view(-1)
    count = flat_source.numel()
    for first in range(0, count, chunk_elements):
        last = min(count, first + chunk_elements)
        flat_landing[first:last].copy_(flat_source[first:last].to(torch.float32), non_blocking=True)


def part_range(total_bytes: int, part: int, num_parts: int) -> tuple[int, int]:
    """Byte range [low, high) of chunk ``part`` when ``total_bytes`` are cut into ``num_parts``
    near-equal chunks (the first ``total % parts`` chunks one byte larger, as the graph counts them)."""
    base, extra = divmod(total_bytes, num_parts)
    low = part * base + min(part, extra)
    return low, low + base + (1 if part < extra else 0)


def element_span(offset: int, size: int, element_size: int, low: int, high: int) -> tuple[int, int]:
    """Elements [first, last) of a tensor occupying bytes [offset, offset + size) whose first byte
    falls in [low, high): every element belongs to exactly one chunk."""
    count = size // element_size
    first = min(count, max(0, -(-(low - offset) // element_size)))
    last = min(count, max(0, -(-(high - offset) // element_size)))
    return first, last


def chunk_spans(sizes: Sequence[tuple[int, int]], num_parts: int) -> list[list[tuple[int, int, int]]]:
    """Tensors laid end to end (``sizes``: each one's bytes and element size) cut into
    ``num_parts`` chunks (`part_range`): per chunk, the (index, first, last) elements
    (`element_span`) of each tensor it overlaps."""
    total = sum(size for size, _ in sizes)
    spans: list[list[tuple[int, int, int]]] = []
    for part in range(num_parts):
        low, high = part_range(total, part, num_parts)
        offset, overlapping = 0, []
        for index, (size, element_size) in enumerate(sizes):
            first, last = element_span(offset, size, element_size, low, high)
            offset += size
            if first < last:
                overlapping.append((index, first, last))
        spans.append(overlapping)
    return spans


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors to ``dtype`` (model inputs enter the compute precision)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, Mapping):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return type(obj)(cast_floating(v, dtype) for v in obj)
    return obj


# --------------------------------------------------------------------- transient storage


class TransientPool:
    """Reuses the storage of finished stages' transient weights.

    Allocating fresh tensors for every upload costs a page fault per page on the CPU backend (the
    upload then runs at a fraction of memory bandwidth); CUDA's caching allocator does the same
    reuse for device memory. Thread-safe: uploads and releases run on different lanes.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def copy_of(self, source: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
        if device.type != "cpu":  # the CUDA caching allocator already reuses device memory
            return source.detach().to(device, non_blocking=True).requires_grad_(requires_grad)
        key = (device, source.shape, source.dtype)
        with self._lock:
            free = self._free.get(key)
            tensor = free.pop() if free else None
        if tensor is None:
            tensor = torch.empty(source.shape, dtype=source.dtype, device=device)
        with torch.no_grad():
            tensor.copy_(source, non_blocking=device.type == "cuda")
        return tensor.requires_grad_(requires_grad)

    def empty_like(self, source: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
        """Uninitialised storage shaped like ``source`` on ``device`` (reused on the CPU)."""
        tensor: torch.Tensor | None = None
        if device.type == "cpu":
            key = (device, source.shape, source.dtype)
            with self._lock:
                free = self._free.get(key)
                tensor = free.pop() if free else None
        if tensor is None:
            tensor = torch.empty(source.shape, dtype=source.dtype, device=device)
        return tensor.requires_grad_(requires_grad)

    def release(self, run: dict[int, dict[str, torch.Tensor]]) -> None:
        with self._lock:
            for named in run.values():
                for tensor in named.values():
                    if tensor.device.type != "cpu":
                        continue
                    tensor.grad = None
                    key = (tensor.device, tensor.shape, tensor.dtype)
                    self._free.setdefault(key, []).append(tensor.detach_())


def pop_frozen(params: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """The tensors without a gradient of a run's transient copy (layer -> name -> tensor), taken
    out of it. A fused or backward run lets them go at its last compute; what trains stays for its
    gradient's download, which on CUDA queues behind the run's outgoing boundary gradients: held
    until then, a 32B base's frozen stage (7.3 GiB) was still on the device at the next stage's
    peak, 2 GiB above the memory model (docs/memory.md, "the draining stage")."""
    return {
        layer: {name: named.pop(name) for name in [n for n, t in named.items() if not t.requires_grad]}
        for layer, named in params.items()
    }
