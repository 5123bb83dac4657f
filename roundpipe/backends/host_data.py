"""What the host keeps between a backend's tasks, and the names it keeps it under.

Why apart from the runtime: the stage math (`roundpipe.backends.runtime`) passes tensors from one
task to the next through a few host-side stores (activations and gradients at stage boundaries,
a stage's uploaded input and computed output, each stage run's transient parameters, each
device's layer replicas). Each store has its own named key, so the code says which triple it
means, and `IterationData` is what one forward_backward call hands to them. Nothing here runs
math or decides when anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

LossFn = Callable[[Any, Any], torch.Tensor]


class BoundaryKey(NamedTuple):
    """An activation or gradient waiting on the host at the input of ``layer``."""

    iteration: int
    layer: int
    microbatch: int


class SlotKey(NamedTuple):
    """A stage's uploaded input (inbox) or computed output (outbox) for one microbatch."""

    iteration: int
    slot: int
    microbatch: int


class RunKey(NamedTuple):
    """One stage run on one device: the transient parameter copy its tasks share."""

    device: int
    iteration: int
    round: int
    slot: int


class ReplicaKey(NamedTuple):
    """A device's structural copy of one layer."""

    device: int
    layer: int


@dataclass
class IterationData:
    """What the host holds for one forward_backward call."""

    inputs: list[Any]
    targets: list[Any]
    weights: list[float]
    loss_fn: LossFn | None
    loss_scale: float
    boundaries: frozenset[int]  # layers whose input a forward stage must save for a backward stage
    # layers whose post-attention residual a forward stage saves beside that input
    # (`roundpipe.model.attention_residual`; recompute_grain="layer_input")
    residuals: frozenset[int] = frozenset()
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # read once the fused stage is done


@dataclass
class LayerTimes:
    """Measured forward milliseconds per layer (exponential moving average)."""

    fwd_ms: list[float | None]
    alpha: float = 0.5

    def add(self, layer: int, ms: float) -> None:
        old = self.fwd_ms[layer]
        self.fwd_ms[layer] = ms if old is None else (1 - self.alpha) * old + self.alpha * ms
