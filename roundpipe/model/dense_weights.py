"""Frozen 4-bit weights dequantized once per stage run, not once per layer call.

Why: an `NF4Linear` dequantizes its weight inside every call, so a backward stage run of four
microbatches dequantizes each weight eight times (each recompute, each backward) and a forward
stage run four times. On a 70B base the dequantizations write ~1.7 GB of bf16 a layer each time,
a tenth of the step. A stage run's weights stay on the device from its first compute to its
last, so one dense copy per run serves every microbatch: the runtime makes it at the run's first
compute (`dequantize_run`), binds it into the replica's ``dense`` slots (`add_dense_slots`), and
drops it at the run's last compute. Frozen experts held in NF4 (`roundpipe.model.experts`) get the
same, one slot per 3-D weight (``gate_up_proj_dense``, ``down_proj_dense``): their grouped products
then run as on a bf16 base, while the link still carries their 4-bit bytes. The price is the stage's dense weights on the device for the
run, which the memory model counts (``LayerMemory.dense_bytes``, from `dense_bytes`), so the
planner cuts smaller stages; ``RunConfig.dequantize`` chooses ("auto": per run where a plan fits
so). The numbers are those of the per-call path: the same dense tensor, the same products.

This module must never keep a dense copy itself: the runtime owns it, for one run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from roundpipe.model.expert_products import NF4Meta, dense_weight
from roundpipe.model.quant import NF4Linear

DENSE = "dense"  # the slot's name on each NF4Linear of a replica; experts: "<weight>_dense"


@dataclass(frozen=True)
class QuantizedSublayer:
    """One 4-bit weight inside a layer: the names of its packed codes, its scales and the dense
    slot it fills (``"mlp.up_proj.packed"``, ``"mlp.up_proj.absmax"``, ``"mlp.up_proj.dense"``),
    and what its bytes dequantize to."""

    packed: str
    absmax: str
    slot: str
    meta: NF4Meta


def _own(module: nn.Module, prefix: str = "") -> list[QuantizedSublayer]:
    """A module's own 4-bit weights, their names under ``prefix``."""
    if isinstance(module, NF4Linear):
        meta = NF4Meta(
            torch.Size((module.out_features, module.in_features)), module.weight_dtype, module.block_size
        )
        return [QuantizedSublayer(f"{prefix}packed", f"{prefix}absmax", f"{prefix}{DENSE}", meta)]
    if not getattr(type(module), "_roundpipe_nf4", False):
        return []
    metas: dict[str, NF4Meta] = getattr(module, "nf4_meta")  # noqa: B009
    return [
        QuantizedSublayer(f"{prefix}{w}_packed", f"{prefix}{w}_absmax", f"{prefix}{w}_{DENSE}", m)
        for w, m in metas.items()
    ]


def quantized_sublayers(layer: nn.Module) -> tuple[QuantizedSublayer, ...]:
    """Every 4-bit weight of ``layer`` (`NF4Linear`s and NF4 experts), in module order (shared
    modules once)."""
    return tuple(
        sub for name, module in layer.named_modules() for sub in _own(module, f"{name}." if name else "")
    )


def dense_bytes(layer: nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes of ``layer``'s dense weights in ``dtype`` (each weight's own dtype when None): what
    a stage run holds for the layer when it dequantizes once per run."""
    total = 0
    for sub in quantized_sublayers(layer):
        total += sub.meta.numel * torch.empty(0, dtype=dtype or sub.meta.dtype).element_size()
    return total


def add_dense_slots(replica: nn.Module) -> None:
    """Give every 4-bit weight of a replica an empty dense parameter slot, which the runtime's
    binder fills for a call of a run that dequantized once (and empties after it)."""
    for module in replica.modules():
        for sub in _own(module):
            if sub.slot not in module._parameters:
                # On the replica's device, as its other (empty) parameter slots: a compiled graph
                # takes it as an input even where it only asks its size.
                empty = torch.empty(0, dtype=sub.meta.dtype, device=getattr(module, sub.packed).device)
                module.register_parameter(sub.slot, nn.Parameter(empty, requires_grad=False))


def dequantize_run(
    sublayers: tuple[QuantizedSublayer, ...], params: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The dense weights of one layer from its transient 4-bit copy ``params`` (name -> tensor on
    the device), keyed by the name of the slot they fill (``"mlp.up_proj.dense"``), in the shape
    and layout the weight had before it was quantized."""
    return {
        sub.slot: dense_weight(params[sub.packed], params[sub.absmax], sub.meta, dtype, compiled=True)
        for sub in sublayers
    }
