"""Data parallel across processes: each unit's host gradient is averaged before its step.

Why there: a unit's gradient is complete on the host once its last G-copy of the step has run;
averaging it from then on (on the thread of `roundpipe.optim.comm_thread`, which keeps every
process's collectives in one order) lets the optimizer lane step the other units and the devices
go on with their work while the bytes travel, and needs no new task kind. The unit's step waits
for its average (when a global gradient norm is needed, the grad-norm barrier waits for all).
Every process then applies the same step to the same fp32 weights, so they stay bitwise equal; a
checksum of the weights is compared every ``check_every`` steps so that a divergence (different
code, seed, optimizer or config on one process) is named instead of training on silently.

Why a dedicated gloo group: gradients live in host memory, and roundpipe's collectives run on a
thread of its own; a group of their own keeps them from interleaving with collectives the
user issues on the default group from other threads. The graph builder chains the steps deepest
first (`ScheduleOptions.ordered_steps`), the order in which the thread averages the units.

Why averaged with equal weight per process: `forward_backward` already makes each process's
gradient the mean over its local batch, so the mean of the processes' gradients is the mean over
the global batch when every process passes a batch of the same size.

This module must never decide when anything runs (the engine does) nor touch devices.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roundpipe.distributed_config import DistributedConfig
from roundpipe.errors import ConfigError, RoundPipeError
from roundpipe.optim.comm_thread import OrderedCollectives
from roundpipe.optim.host import HostModel


class DistributedError(RoundPipeError, RuntimeError):
    """A collective across processes failed, or the processes' weights diverged."""


class Collectives:
    """What the optimizer lane does across processes: nothing, for a single process."""

    active = False
    rank = 0
    world_size = 1

    def step_scheduled(self, step: int, last_iteration: int) -> None:
        """Step ``step`` (0-based) will apply the gradients of iterations up to ``last_iteration``."""

    def after_g_copy(self, iteration: int, unit: int) -> None:
        """``unit``'s G-copy of ``iteration`` ran."""

    def before_norm(self, step: int) -> None:
        """Before the global gradient norm of ``step`` is computed."""

    def before_step(self, step: int, unit: int) -> None:
        """Before ``unit``'s optimizer step ``step``."""

    def after_step(self, step: int, unit: int) -> None:
        """After ``unit``'s optimizer step ``step``."""


LOCAL = Collectives()


def torchrun_environment() -> bool:
    """torchrun (or a launcher like it) set the variables of a several-process job."""
    return "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def several_processes() -> bool:
    """This process is one of several: under torchrun, or in an initialised group of two or more."""
    if torchrun_environment():
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def make_collectives(config: DistributedConfig, host: HostModel) -> Collectives:
    """Gradient averaging across the processes ``config`` names, or `LOCAL` when there are none.

    Every process of the default group must call this (building the group is a collective)."""
    if config.mode == "off":
        return LOCAL
    available = dist.is_available()
    if available and not dist.is_initialized() and torchrun_environment():
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.timeout_s))
    if not available or not dist.is_initialized() or dist.get_world_size() < 2:
        if config.mode == "on":
            raise ConfigError(
                'RunConfig.distributed.mode="on" but torch.distributed has no group of several processes; '
                "launch with torchrun (docs/distributed.md) or call torch.distributed.init_process_group first"
            )
        return LOCAL
    world = dist.get_world_size()
    ranks = list(config.ranks) if config.ranks is not None else list(range(world))
    if ranks[-1] >= world:
        raise ConfigError(
            f"RunConfig.distributed.ranks={tuple(ranks)} names rank {ranks[-1]} but there are only {world} "
            "processes; name ranks below the world size or leave ranks=None for every process"
        )
    group = dist.new_group(ranks, timeout=timedelta(seconds=config.timeout_s), backend=config.backend)
    if dist.get_rank() not in ranks:
        return LOCAL
    return GradientAverager(host, group, config)


class GradientAverager(Collectives):
    """Averages each unit's fp32 host gradient across ``group`` and checks the weights agree."""

    active = True

    def __init__(self, host: HostModel, group: Any, config: DistributedConfig) -> None:
        self.host = host
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.timeout_s = config.timeout_s
        self.check_every = config.check_every
        self._last_unit = host.units[0]  # steps run deepest first: the shallowest ends a step
        self._start_equal()
        self.thread = OrderedCollectives(
            list(reversed(host.units)),
            self._average,
            self.check_weights,
            self._check_due,
            idle_s=config.timeout_s,
        )

    def _start_equal(self) -> None:
        """Every process starts from the weights of the group's first rank, as DDP does: models
        initialised at random with different seeds would otherwise never agree."""
        with torch.no_grad():
            for unit in self.host.units:
                for param in self.host.unit_params[unit]:
                    self._call(dist.broadcast, self.host.master[id(param)], "weights at start", src_rank=0)
        self.host.p_copy_all()

    def _call(self, op: Any, tensor: torch.Tensor, what: str, **kwargs: Any) -> None:
        """Run collective ``op`` on ``tensor``; a failure names this rank and the likely cause."""
        if "src_rank" in kwargs:
            kwargs["src"] = dist.get_global_rank(self.group, kwargs.pop("src_rank"))
        try:
            op(tensor, group=self.group, **kwargs)
        except RuntimeError as exc:
            raise DistributedError(
                f"rank {self.global_rank} (of {self.world_size} in roundpipe's group): the collective for "
                f"{what} failed: {exc}. Another process probably stopped or failed (see its log) or did "
                f"not answer within RunConfig.distributed.timeout_s={self.timeout_s}s"
            ) from exc

    # ------------------------------------------------------------------ optimizer-lane hooks

    def step_scheduled(self, step: int, last_iteration: int) -> None:
        self.thread.step_scheduled(step, last_iteration)

    def after_g_copy(self, iteration: int, unit: int) -> None:
        self.thread.after_g_copy(iteration, unit)  # the average can start before the step task

    def before_norm(self, step: int) -> None:
        for unit in self.thread.order:
            self.thread.ready(step, unit)
        for unit in self.thread.order:
            self.thread.wait("done", step, unit)

    def before_step(self, step: int, unit: int) -> None:
        self.thread.ready(step, unit)
        self.thread.wait("done", step, unit)

    def after_step(self, step: int, unit: int) -> None:
        if unit == self._last_unit:
            self.thread.stepped(step)
            if self._check_due(step):
                self.thread.wait("checked", step)

    def _check_due(self, step: int) -> bool:
        return bool(self.check_every) and (step + 1) % self.check_every == 0

    # ------------------------------------------------------------------ the work

    @torch.no_grad()
    def _average(self, step: int, unit: int) -> None:
        """Average ``unit``'s gradients in place. Which parameters have one is agreed first: a
        parameter without a gradient on some process counts as zero there, and one without a
        gradient anywhere keeps none (its optimizer skips it, as on one process)."""
        masters = [self.host.master[id(p)] for p in self.host.unit_params[unit]]
        present = torch.tensor([float(m.grad is not None) for m in masters])
        what = f"the gradient of layer {unit} at step {step + 1}"
        self._call(dist.all_reduce, present, what)
        for master, count in zip(masters, present.tolist(), strict=True):
            if count == 0:
                continue
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            self._call(dist.all_reduce, master.grad, what)
            master.grad.div_(self.world_size)

    @torch.no_grad()
    def checksum(self) -> int:
        """The sum of the fp32 weights' bit patterns: equal weights give equal sums, and any
        changed bit changes it (an exact integer, unlike a float sum)."""
        total = 0
        for unit in self.host.units:
            for param in self.host.unit_params[unit]:
                bits = self.host.master[id(param)].detach().reshape(-1).view(torch.int32)
                total += int(torch.sum(bits, dtype=torch.int64))
        return total

    def check_weights(self, step: int) -> None:
        """Compare the weights' checksum across the group; raise naming the ranks that differ."""
        sums = torch.zeros(self.world_size, dtype=torch.int64)
        sums[self.rank] = self.checksum()
        self._call(dist.all_reduce, sums, f"the weight checksum after step {step + 1}")
        values = sums.tolist()
        if len(set(values)) == 1:
            return
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        differ = [ranks[r] for r, value in enumerate(values) if value != values[0]]
        raise DistributedError(
            f"the host weights diverged after step {step + 1}: ranks {differ} differ from rank {ranks[0]} "
            f"(checksums {dict(zip(ranks, values, strict=True))}). Every process must run the same code, "
            "optimizer, learning-rate schedule and RunConfig, and call forward_backward and step the same "
            "number of times"
        )
