"""Delay-aware learning-rate ramp for the asynchronous optimizer (a PipeMare-style remedy).

Why: a gradient one step late is stable only at a much smaller learning rate than a fresh one
(docs/design.md, "Staleness remedies, measured"), and Adam runs near that edge. Right after the
switch to staleness 1 the schedule is at its peak, which is where the delay hurts most. This ramp
multiplies the learning rate of the first ``steps`` asynchronous optimizer steps by a factor that
rises linearly from ``start`` to 1, like PipeMare's learning-rate warm-up for delayed pipelines.
It only rescales the step: the user's optimizer and scheduler are untouched, and the factor
depends on the step index alone, so a resumed run applies the same factors.

This module must never decide when a step runs, nor keep state of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def ramp_factor(step: int, first_async: int, steps: int, start: float) -> float:
    """The multiplier of optimizer step ``step`` (0-based): 1 before ``first_async`` (sync
    steps) and after the ramp; ``start + (1 - start) * (step - first_async + 1) / steps`` on it."""
    if steps <= 0 or step < first_async:
        return 1.0
    done = min(1.0, (step - first_async + 1) / steps)
    return start + (1.0 - start) * done


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Run an ``optimizer.step()`` with every param group's lr times ``factor``; the lr values
    are put back exactly as they were (the same objects), so schedulers and checkpoints never
    see the scaled value."""
    if factor == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
