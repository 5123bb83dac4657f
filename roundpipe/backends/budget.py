"""A device's memory budget: the default (free memory less a reserve) and its enforcement.

Why apart from the profile: the budget is decided before anything is measured or allocated, from
the card's free memory, and enforced by the caching allocator's per-process fraction, so a large
card can stand in for a smaller one; the profile then measures what runs inside it. The budget is
also the first thing to touch a card, so the check that the devices named exist lives here too
(`require_devices`, which the CUDA backend calls as well).
"""

from __future__ import annotations

import torch

from roundpipe.errors import ConfigError
from roundpipe.plan.sizes import format_bytes

GiB = 2**30


def require_devices(device_indices: tuple[int, ...]) -> None:
    """Raise a `ConfigError` that says what to change unless CUDA is usable here and every device
    of ``device_indices`` exists: checked before anything reads a card (the budget's free memory,
    the backend's streams), where torch would raise its own error from deep inside."""
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "torch finds no usable NVIDIA GPU or driver"
        )
        named = ",".join(str(i) for i in device_indices)
        raise ConfigError(
            f'devices="cuda:{named}" but CUDA is not available ({why}); use devices="cpu:N" to '
            "train on CPU workers, or run where torch.cuda.is_available() is True"
        )
    count = torch.cuda.device_count()
    for index in device_indices:
        if not 0 <= index < count:
            raise ConfigError(
                f"cuda:{index} does not exist: this machine has {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1}); name devices among them"
            )


def default_reserve_bytes(total_bytes: int) -> int:
    """What the default budget leaves free: max(1 GiB, 5% of the card).

    The CUDA context is already outside the free memory when it is read; the reserve covers what
    comes after: cuBLAS/cuDNN workspaces (tens of MiB per stream, five streams per device), NCCL
    buffers with several GPUs, and the caching allocator's rounding and fragmentation, which grow
    with the card (a few percent of what it hands out).
    """
    return max(GiB, total_bytes // 20)


def default_budget(device_index: int, reserve_bytes: int | None = None) -> int:
    """The free memory of ``cuda:device_index`` now, less ``reserve_bytes`` (default
    `default_reserve_bytes`): the budget when the user sets none."""
    free, total = torch.cuda.mem_get_info(device_index)
    reserve = default_reserve_bytes(int(total)) if reserve_bytes is None else reserve_bytes
    budget = int(free) - reserve
    if budget <= 0:
        raise ConfigError(
            f"cuda:{device_index} has only {format_bytes(free)} free of {format_bytes(total)}, less than the "
            f"{format_bytes(reserve)} reserve; free the device (another process holds it) or set "
            "RunConfig.memory_budget explicitly"
        )
    return budget


def enforce_budget(device_index: int, budget_bytes: int) -> float:
    """Cap this process's allocations on ``cuda:device_index`` at ``budget_bytes`` (the caching
    allocator raises out-of-memory beyond it), so a large card behaves like a smaller one.
    Returns the fraction of the card set; a budget at or above the card sets no cap (1.0)."""
    total = int(torch.cuda.get_device_properties(device_index).total_memory)
    if budget_bytes <= 0:
        raise ConfigError(f"memory budget {budget_bytes} for cuda:{device_index} must be positive")
    fraction = min(1.0, budget_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device_index)
    return fraction
