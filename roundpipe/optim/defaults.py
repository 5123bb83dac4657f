"""What a run gets unless it says otherwise: the host AdamW and the fp16 loss scaler.

Why a module of its own: both are small policies a user replaces (an optimizer factory, a fixed
scale), while `roundpipe.optim.host` holds the copies and the operations on them, which never
change with the choice. It must never touch the host copies, decide ordering or start threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def host_adamw(
    params: Sequence[torch.Tensor] | Sequence[dict[str, Any]], **options: Any
) -> torch.optim.AdamW:
    """AdamW on host tensors with torch's fused CPU kernel.

    The optimizer copies always live in host RAM, and on CPU tensors torch's AdamW defaults to
    its per-tensor loop: several kernels per parameter tensor, each a pass over memory. The
    fused kernel makes one vectorised pass per tensor: 8x faster on 0.74M parameters shaped
    like a decoder block, 8x on 101M parameters in 25M-parameter units (``bench/host_optimizer.py --kernel``),
    which keeps the optimizer lane of a large model off the critical path and a fresh unit's
    step short. It rounds differently from the loop (about one ulp per step), so a reference
    loop compared to the pipe must use it too. Without the kernel (torch built without it)
    torch's default loop is used.
    """
    try:
        return torch.optim.AdamW(params, fused=True, **options)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **options)


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return host_adamw(params, lr=1e-4)


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (the step is skipped), double after
    ``growth_interval`` clean steps."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    dynamic: bool = True
    clean_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            if found_inf:
                self.skipped_steps += 1
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
