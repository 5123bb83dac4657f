"""What the runtime holds on one device, by part and by run: the facts an out-of-memory needs;
and `TaskHolds`, which keeps what a task's device work reads alive until the task has run.

Why: when a device runs out of memory under a plan predicted to fit, the prediction is wrong
about something, and the only witness is the runtime's own state at that moment: whose weights
and gradients are still on the device, which uploaded activations and gradients wait for their
task, what recomputes keep for their backward, what a copy stream still reads (`Runtime.hold`).
This module walks that state and sums the device bytes of each part, every storage counted once.
The remainder (the device's allocated bytes less everything named) is what autograd graphs and
kernels hold: saved activations of recomputes and fused stages, working memory.

It reads without locks from whatever thread reports the failure while other lanes keep running,
so it copies each container before walking it and never raises: a diagnostic must not replace
the error it explains.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from roundpipe.backends.stage_math import Recomputed
from roundpipe.backends.storages import storage_bytes, storage_key
from roundpipe.errors import DeviceOutOfMemoryError
from roundpipe.plan.sizes import format_bytes
from roundpipe.sched.task import Task


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (nested dicts, lists, tuples, recomputes; a parameter's
    gradient too), without following anything else."""
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.is_leaf and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for value in list(obj.values()):
            yield from _tensors(value, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in list(obj):
            yield from _tensors(value, depth + 1)
    elif isinstance(obj, Recomputed):
        yield from _tensors([obj.outputs, obj.leaves, obj.inputs, obj.uploaded], depth + 1)
        yield from _saved_by_graph(obj.outputs)


def _saved_by_graph(outputs: list[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    """The tensors autograd keeps for the graph behind ``outputs``: each node's ``_saved_*``
    attributes (built-in nodes) and ``saved_tensors`` (custom and compiled functions). Nodes
    whose tensors were already freed by a backward are skipped."""
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        names = [n for n in dir(node) if n.startswith("_saved_")] + ["saved_tensors"]
        for name in names:
            try:
                value = getattr(node, name)
            except Exception:  # freed by a backward, or not a tensor attribute
                continue
            yield from _tensors(value, 5)
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))


class _Counter:
    """Device bytes per label, each storage counted under the first label that reaches it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, label: str, obj: Any) -> None:
        total = 0
        for tensor in _tensors(obj):
            if tensor.device != self.device:
                continue
            key, size = storage_key(tensor), storage_bytes(tensor)
            if key in self.seen or size == 0:
                continue
            self.seen.add(key)
            total += size
        if total:
            self.bytes[label] = self.bytes.get(label, 0) + total


class TaskHolds:
    """What a task's device work reads on another stream, kept alive until the task has run (the
    runtime's ``_holds``, by task key, under ``_holds_lock``)."""

    _holds: dict[Any, list[Any]]
    _holds_lock: threading.Lock

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


def _snapshot(container: Any) -> list[tuple[Any, Any]]:
    for _ in range(3):  # another lane may resize it while we copy
        try:
            return list(container.items())
        except RuntimeError:
            continue
    return []


def device_holdings(runtime: Any, device: torch.device, seen: set[int] | None = None) -> dict[str, int]:
    """Bytes of ``device`` held by each part of ``runtime``'s state, largest first. Labels name
    the part and its run or slot: ``weights+grads it2 slot15``, ``recompute it2 slot25 mb1``.
    ``seen`` (when given) receives the storages counted."""
    counter = _Counter(device)
    if seen is not None:
        counter.seen = seen
    for run, params in _snapshot(runtime.transient):
        counter.add(f"weights+grads it{run.iteration} slot{run.slot}", params)
    for run, params in _snapshot(runtime.dense.runs):  # the transient tensors among them counted above
        counter.add(f"dense copies it{run.iteration} slot{run.slot}", params)
    parts: Iterable[tuple[str, Any]] = (
        ("recompute", runtime.recomputed),
        ("activation in", runtime.inbox),
        ("gradient in", runtime.grad_inbox),
        ("output out", runtime.outbox),
    )
    for name, container in parts:
        for key, value in _snapshot(container):
            counter.add(f"{name} it{key.iteration} slot{key.slot} mb{key.microbatch}", value)
    for key, items in _snapshot(runtime._holds):
        counter.add(f"held for {key}", [item for item in items if not callable(item)])
    return dict(sorted(counter.bytes.items(), key=lambda kv: -kv[1]))


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except Exception:  # a weak proxy whose referent is gone raises ReferenceError
        return False


def tensors_elsewhere(device: torch.device, named: set[int], top: int = 6) -> str:
    """The live tensors on ``device`` that the runtime's state does not reach (storages not in
    ``named``), grouped by shape and dtype: what a leak or a kept autograd graph is made of. Walks
    every object the garbage collector tracks, so only for failures."""
    groups: dict[str, list[int]] = {}
    seen = set(named)
    with warnings.catch_warnings():  # isinstance on lazy module attributes warns of deprecations
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in objects:
        try:
            if obj.device != device:
                continue
            key, size = storage_key(obj), storage_bytes(obj)
        except Exception:  # a tensor subclass or a freed storage: not what we look for
            continue
        if key in seen or size == 0:
            continue
        seen.add(key)
        entry = groups.setdefault(f"{list(obj.shape)} {str(obj.dtype).replace('torch.', '')}", [0, 0])
        entry[0] += 1
        entry[1] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return ", ".join(f"{key} x{count} {format_bytes(size)}" for key, (count, size) in ranked) or "none"


def describe_holdings(holdings: dict[str, int], allocated: int | None, top: int = 8) -> str:
    """One line: the largest holdings, the rest summed, and what the state does not explain."""
    items = list(holdings.items())
    shown = [f"{label} {format_bytes(size)}" for label, size in items[:top]]
    rest = sum(size for _, size in items[top:])
    if rest:
        shown.append(f"{len(items) - top} more {format_bytes(rest)}")
    if allocated is not None:
        unnamed = allocated - sum(holdings.values())
        shown.append(f"not in the runtime's state (autograd graphs, working memory) {format_bytes(unnamed)}")
    return "; ".join(shown) if shown else "nothing"


def _guarded(describe: Callable[[], str]) -> str:
    try:
        return describe()
    except Exception as exc:  # the diagnostic must never hide the failure it explains
        return f"unknown ({type(exc).__name__}: {exc})"


def _collected(device: torch.device, allocated: int | None) -> str:
    """What only the cycle collector would have freed: a leak, not the plan's memory."""
    gc.collect()
    freed = 0 if allocated is None else allocated - torch.cuda.memory_allocated(device)
    return format_bytes(max(0, freed))


def out_of_memory_error(runtime: Any, task: Any, where: str) -> DeviceOutOfMemoryError:
    """Running out of memory on a plan that was predicted to fit is a bug in the prediction: the
    error says what was predicted (for the failing slot and the plan's peak), what the device
    measured, and what the runtime held at that moment."""
    device = runtime.device(task.device)
    note = ""
    prediction = runtime.memory_prediction
    starts = [first for first in runtime.memory_predictions if first <= task.iteration]
    if starts:  # the plan this task's iteration was built for (a re-plan may have come since)
        prediction = runtime.memory_predictions[max(starts)]
    if prediction is not None:
        if 0 <= task.slot < len(prediction.slots) and task.slot != prediction.peak_slot.index:
            note = f"; this slot's {prediction.describe(task.slot)}"
        note += f"; the plan's {prediction.describe()}"
    allocated = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
        note += f"; measured peak on {device}: {peak / 2**30:.2f} GiB"
    named: set[int] = set()
    held = _guarded(lambda: describe_holdings(device_holdings(runtime, device, named), allocated))
    note += f"; held on {device} at the failure (iteration {task.iteration}): {held}"
    if device.type == "cuda":
        note += f"; live tensors outside it: {_guarded(lambda: tensors_elsewhere(device, named))}"
        note += f"; a garbage collection then freed {_guarded(lambda: _collected(device, allocated))}"
    dense = ', dequantize="call" (4-bit weights dense in each call, not for a whole stage run)'
    return DeviceOutOfMemoryError(
        f"out of memory in {where}{task.kind} of stage {task.stage} on device {task.device}, "
        f"microbatch {task.microbatch}{note}. Use more microbatches (smaller ones), "
        f'recompute_grain="layer"{dense if runtime.dense.enabled else ""}, a shorter sequence, or a '
        "smaller RunConfig.memory_budget so the plan makes smaller stages",
        task.describe(),
    )


__all__ = ["describe_holdings", "device_holdings", "out_of_memory_error"]
