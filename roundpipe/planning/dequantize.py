"""When a 4-bit base becomes dense on the device: once per stage run where a plan fits so.

Why a choice of the planner: dequantizing once per run (`roundpipe.model.dense_weights`) saves
most of the dequantizations of a run of several microbatches but holds the stage's dense weights
for the run, four times its 4-bit bytes and more; the memory budget decides whether stages small
enough for that still fit. ``RunConfig.dequantize="auto"`` plans with the dense copies counted
(``LayerMemory.dense_bytes``) and falls back to dequantizing in each call where no plan fits,
and where a run holds one microbatch (it would save one dequantization in three, its backward's,
for a stage's dense weights: a 262,144-token sequence needs that memory for its activations);
the runtime follows the memory table of the plan it runs (`dense_weights_of`).

This module must never measure, dequantize or touch a device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch
from torch import nn

from roundpipe.config import RunConfig
from roundpipe.errors import PlanError
from roundpipe.model.dense_weights import dense_bytes
from roundpipe.plan.layer_memory import LayerMemory

Planned = TypeVar("Planned")


def plan_dequantizing(
    config: RunConfig,
    memory: LayerMemory,
    plan_with: Callable[[LayerMemory], Planned],
    layers: Sequence[nn.Module],
    dtype: torch.dtype | None,
) -> Planned:
    """``plan_with(memory)``, with the dense copies of each layer's 4-bit weights counted where
    ``config.dequantize`` asks for them ("run") or allows them and a plan fits ("auto")."""
    dense = tuple(dense_bytes(layer, dtype) for layer in layers)
    per_call = replace(memory, dense_bytes=())
    single = config.num_microbatches == 1 or config.round_size == 1
    if config.dequantize == "call" or not any(dense) or (single and config.dequantize == "auto"):
        return plan_with(per_call)
    try:
        return plan_with(replace(memory, dense_bytes=dense))
    except PlanError as exc:
        if config.dequantize == "run":
            raise PlanError(
                f"{exc}. With dequantize='run' each stage also holds its dense weights for its run "
                f"({sum(dense) / 2**30:.1f} GiB for the whole model); dequantize='call' (or 'auto') "
                "dequantizes inside each layer call instead"
            ) from exc
    return plan_with(per_call)


def dense_weights_of(memory: LayerMemory) -> bool:
    """Whether a run planned on ``memory`` dequantizes once per stage run."""
    return any(memory.dense_bytes)


def per_call_layers_of(memory: LayerMemory) -> frozenset[int]:
    """The layers that dequantize in each call in a run planned on ``memory`` where others hold
    dense copies (none where none do): those the table counts no copies for."""
    if not dense_weights_of(memory):
        return frozenset()
    return frozenset(layer for layer, held in enumerate(memory.dense_bytes) if not held)
