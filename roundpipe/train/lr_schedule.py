"""The optimizer and learning-rate schedule of `roundpipe train`: AdamW, linear warmup, cosine.

Why apart from the loop: the schedule is a pure function of the options and the step, which the
loop, the metrics log and the benches (bench/async_quality.py) all read; keeping it here lets
them import it without the loop. It must never hold state: resume is exact because the learning
rate of step ``s`` is computed from ``s`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.optim.host import host_adamw
from roundpipe.train.config import TrainConfig


def lr_factor(config: TrainConfig, step: int) -> float:
    """Multiplier of ``config.lr`` for the optimizer step with 0-based index ``step``: linear
    warmup, then a cosine from 1 down to ``min_lr_ratio`` at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(config: TrainConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return host_adamw(params, lr=config.lr, weight_decay=config.weight_decay)

    return make


def make_scheduler(config: TrainConfig) -> Callable[[torch.optim.Optimizer], Any]:
    def make(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(config, step))

    return make


__all__ = ["lr_factor", "make_optimizer", "make_scheduler"]
