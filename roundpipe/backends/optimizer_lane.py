"""The optimizer-lane tasks: gradient copies, the global norm, the optimizer step, weight copies.

Why a module of their own: these tasks touch only host memory (`roundpipe.optim.host.HostModel`)
and the collectives that average gradients across processes, never a device or a stage's tensors;
keeping them apart from the device-side stage tasks of `roundpipe.backends.runtime` keeps each
file about one lane. `OptimizerLane` is a base of `Runtime`, which supplies the attributes it
declares.

This module must never decide when anything runs (that is the engine's job) nor touch device
tensors: everything here reads and writes the host model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from roundpipe.backends.host_data import IterationData
from roundpipe.optim.distributed import Collectives
from roundpipe.optim.host import HostModel
from roundpipe.sched.task import Task


class OptimizerLane:
    """G-copy, grad-norm, step and P-copy over the host model, with weight prediction."""

    host: HostModel
    iterations: dict[int, IterationData]
    collectives: Collectives
    scaler: Any
    max_grad_norm: float | None
    # (1-based step, norm) of the first step whose global gradient norm was NaN/inf.
    non_finite_grad_norm: tuple[int, float] | None
    predict_from: int | None
    lr_scale: Callable[[int], float]
    fresh_units: frozenset[int]

    def g_copy(self, task: Task) -> None:
        data = self.iterations.get(task.iteration)
        self.host.g_copy(task.layers.start, data.loss_scale if data is not None else 1.0)
        self.collectives.after_g_copy(task.iteration, task.layers.start)

    def grad_norm(self, task: Task) -> None:
        check = self.scaler is not None
        self.collectives.before_norm(task.step)  # the norm (and clipping) of the averaged gradient
        norm = self.host.grad_norm(self.max_grad_norm, check)
        if not check and not math.isfinite(norm) and self.non_finite_grad_norm is None:
            # Without a loss scaler nothing skips this step: remember it for whoever watches.
            self.non_finite_grad_norm = (task.step + 1, norm)
        if self.scaler is not None:
            self.scaler.update(self.host.found_inf)

    def _predicts(self, step: int, unit: int) -> bool:
        return self.predict_from is not None and step >= self.predict_from and unit not in self.fresh_units

    def step(self, task: Task) -> None:
        self.collectives.before_step(task.step, task.layers.start)
        unit, step = task.layers.start, task.step
        self.host.step(unit, remember=self._predicts(step, unit), lr_scale=self.lr_scale(step))
        self.collectives.after_step(task.step, task.layers.start)

    def p_copy(self, task: Task) -> None:
        unit = task.layers.start
        self.host.p_copy(unit, predict=self._predicts(task.step, unit))


__all__ = ["OptimizerLane"]
