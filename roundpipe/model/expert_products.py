"""The products of an experts module's 3-D weights, whatever form the weight is held in.

Why apart from the experts layer: a grouped product reads its weight in one of three forms (the
module's dense parameter, a stage run's dense copy of a 4-bit weight bound into its slot by
`roundpipe.model.dense_weights`, or the 4-bit bytes themselves, dequantized right before the
product), and two callers need it: the experts' forward (`project`) and a recompute that leaves
the experts' output out and computes only that product's input gradient
(`roundpipe.model.experts_tail`, through `product_input_grad`). One place decides which form a
product reads, so the two can never read different weights.

What holds: `project` computes what ``grouped_mm`` of the dense weight computes (the NF4 form
dequantizes to the same dense tensor a run's copy holds), and `product_input_grad` what autograd's
gradient of `project`'s input computes, bit for bit; nothing reads a value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.model.grouped_mm import grouped_mm
from roundpipe.model.nf4 import NF4Weight, dequantize_nf4
from roundpipe.model.routing import Routing


@dataclass(frozen=True)
class NF4Meta:
    """What the NF4 bytes of one expert weight dequantize to: its 3-D ``shape``, ``dtype`` and
    ``block_size`` (blocks run along each expert's flattened matrix and never straddle two)."""

    shape: torch.Size
    dtype: torch.dtype
    block_size: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def dense_weight(
    packed: torch.Tensor, absmax: torch.Tensor, meta: NF4Meta, dtype: torch.dtype, compiled: bool
) -> torch.Tensor:
    """The dense weight in its stored layout, on the device of its bytes (a new tensor): the packed
    codes and the scales' raw bytes as stored (any shape), ``meta`` what they dequantize to."""
    scales = absmax.reshape(-1).view(torch.float32)
    q = NF4Weight(packed.reshape(-1), scales, meta.shape, meta.dtype, meta.block_size)
    return dequantize_nf4(q, dtype, compiled=compiled and packed.is_cuda)


def _oriented(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``[E, in, out]``, the operand `grouped_mm` takes, from the stored layout."""
    return weight if transposed else weight.transpose(-2, -1)


class _NF4GroupedMM(torch.autograd.Function):
    """`grouped_mm` of ``x`` with a frozen expert weight held in NF4, dequantized to ``x``'s dtype
    in the forward and again in the backward: autograd saves the 4-bit bytes and the offsets,
    never the dense weight (a plain ``grouped_mm`` would save it for the input's gradient). No
    gradient reaches the weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        offsets: torch.Tensor,
        meta: NF4Meta,
        transposed: bool,
        compiled: bool,
        dispatched: bool,
    ) -> torch.Tensor:
        weight = dense_weight(packed, absmax, meta, x.dtype, compiled)
        ctx.save_for_backward(packed, absmax, offsets)
        ctx.meta, ctx.transposed, ctx.compiled, ctx.dispatched = meta, transposed, compiled, dispatched
        return grouped_mm(x, _oriented(weight, transposed), offsets, dispatched=dispatched)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None, None
        packed, absmax, offsets = ctx.saved_tensors
        nf4 = (packed, absmax, ctx.meta, ctx.compiled)
        grad_x = product_input_grad(
            grad, None, nf4, offsets, transposed=ctx.transposed, dispatched=ctx.dispatched
        )
        return grad_x, None, None, None, None, None, None, None


NF4Bytes = tuple[torch.Tensor, torch.Tensor, NF4Meta, bool]
"""A weight held in 4 bits: its packed codes, its scales' raw bytes, its `NF4Meta`, and whether to
dequantize it with the compiled kernel."""


def weight_form(experts: nn.Module, name: str) -> tuple[torch.Tensor | None, NF4Bytes | None]:
    """What the product of the experts' weight ``name`` reads: a dense weight (a stage run's bound
    copy of a 4-bit weight, or the module's own parameter), else its 4-bit bytes."""
    quantized: dict[str, NF4Meta] | None = getattr(experts, "nf4_meta", None)
    if quantized is None or name not in quantized:
        weight: torch.Tensor = getattr(experts, name)
        return weight, None
    # A stage run's dense copy of a 4-bit weight (`roundpipe.model.dense_weights`), when bound;
    # an empty tensor is the placeholder of a replica's slot.
    bound: torch.Tensor | None = getattr(experts, f"{name}_dense", None)
    if bound is not None and bound.numel():
        return bound, None
    compiled = bool(getattr(experts, "compiled", False))
    return None, (
        getattr(experts, f"{name}_packed"),
        getattr(experts, f"{name}_absmax"),
        quantized[name],
        compiled,
    )


def project(
    experts: nn.Module, name: str, x: torch.Tensor, routing: Routing, *, transposed: bool, bias: bool
) -> torch.Tensor:
    """``x[rows of e] @ W_e`` (+ ``<name>_bias[e]`` with ``bias``) for the experts' weight ``name``
    (stored ``[E, in, out]`` when ``transposed``, else ``[E, out, in]``)."""
    dispatched = bool(getattr(experts, "dispatch_products", False))  # `experts.dispatch_products`
    weight, nf4 = weight_form(experts, name)
    out: torch.Tensor
    if nf4 is not None:
        packed, absmax, meta, compiled = nf4
        out = _NF4GroupedMM.apply(x, packed, absmax, routing.offsets, meta, transposed, compiled, dispatched)
    else:
        assert weight is not None
        out = grouped_mm(x, _oriented(weight, transposed), routing.offsets, dispatched=dispatched)
    if bias:
        bias_rows: torch.Tensor = getattr(experts, f"{name}_bias")
        out = out + bias_rows[routing.expert].to(out.dtype)
    return out


def product_input_grad(
    grad: torch.Tensor,
    weight: torch.Tensor | None,
    nf4: NF4Bytes | None,
    offsets: torch.Tensor,
    *,
    transposed: bool,
    dispatched: bool,
) -> torch.Tensor:
    """``grad[rows of e] @ W_e^T``: the gradient of `project`'s input for its output gradient
    ``grad``, from the weight alone (`weight_form`'s ``weight`` or ``nf4``), as the backward of a
    frozen weight's product computes it."""
    if weight is None:
        assert nf4 is not None
        packed, absmax, meta, compiled = nf4
        weight = dense_weight(packed, absmax, meta, grad.dtype, compiled)
    mat_b = _oriented(weight, transposed).transpose(-2, -1)
    return grouped_mm(grad, mat_b, offsets, dispatched=dispatched)
