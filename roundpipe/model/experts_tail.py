"""A recompute leaves out a mixture-of-experts layer's output: its down products and their sum.

Why: a Qwen3-MoE or GPT-OSS decoder layer ends ``residual + experts(h)``, and a recompute whose
output is only a backward's root never reads that value (`roundpipe.model.frozen_tail` says why
for a dense layer). What the backward needs from the experts' tail is less than its forward: with
the routed rows' output gradient ``r`` (each token's gradient, once per choice, in expert order),
``out_e = inner @ W_e (+ b_e)`` and the router weight ``w`` of each row,

    d inner = w * (r @ W_e^T)        d w = <r, inner @ W_e + b_e> = <r @ W_e^T, inner> + <r, b_e>

so one grouped product of the gradient with the frozen down weight gives both, and the forward's
down product, the weighting, the rows put back in token order and the sum over the choices are
left out: a third of the experts' matrix work of the recompute (Qwen3-30B-A3B: 768 x 2,048 of
the 2,048 x 1,536 + 768 x 2,048 weights a routed row) and the passes over ``tokens x k`` rows of
the hidden width, the largest tensors of the layer. The backward saves ``inner`` (a row of the
intermediate width) where the full path saves the weighted output (a row of the hidden width).

Where: `roundpipe.model.experts.grouped_experts` takes this path while the experts module's
``output_unread`` flag is set, which `roundpipe.model.frozen_tail.unread_tail` does only around a
recompute call whose output is a backward's root, and `frozen_tail.mark_tail` marks only frozen,
unparametrized experts of the layers it lists (their down weight gets no gradient, so none of its
product's output is needed for one).

What holds: the gradients of the layer's input, its router and everything before are those of the
full recompute up to rounding: ``d w`` sums over the intermediate width instead of the hidden
width, and ``d inner`` multiplies by ``w`` after the product instead of before it (in fp32 on CPU
within 1e-5 relative, `tests/test_experts_tail.py`). Unlike the dense tail, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.model.expert_products import NF4Meta, product_input_grad, weight_form
from roundpipe.model.routing import Routing, sort_choices


@dataclass(frozen=True)
class _DownProduct:
    """How the backward reads the down weight: its 4-bit form's metadata (None when dense), the
    compiled dequantization, the stored layout and how the grouped product is called."""

    meta: NF4Meta | None
    compiled: bool
    transposed: bool
    dispatched: bool


class _UnreadExperts(torch.autograd.Function):
    """Zeros where the experts' output would be, with its gradients for ``inner`` (the rows' input
    of the down product, in expert order) and ``weights`` (each row's router weight): module
    docstring. ``hidden`` gives the output's shape and dtype and gets no gradient here."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inner: torch.Tensor,
        weights: torch.Tensor,
        hidden: torch.Tensor,
        token: torch.Tensor,
        offsets: torch.Tensor,
        expert: torch.Tensor,
        down: torch.Tensor,
        absmax: torch.Tensor | None,
        bias: torch.Tensor | None,
        how: _DownProduct,
    ) -> torch.Tensor:
        ctx.save_for_backward(inner, weights, token, offsets, expert, down, absmax, bias)
        ctx.how = how
        return torch.zeros_like(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        inner, weights, token, offsets, expert, down, absmax, bias = ctx.saved_tensors
        how: _DownProduct = ctx.how
        nf4 = (down, absmax, how.meta, how.compiled) if how.meta is not None else None
        rows = grad[token]  # each token's gradient once per choice, in expert order
        unweighted = product_input_grad(
            rows, None if nf4 else down, nf4, offsets, transposed=how.transposed, dispatched=how.dispatched
        )
        grad_inner = unweighted * weights.unsqueeze(-1).to(unweighted.dtype)
        dots = (unweighted.float() * inner.float()).sum(dim=-1)
        if bias is not None:
            dots = dots + (rows.float() * bias[expert].float()).sum(dim=-1)
        nones = (None,) * 8
        return (grad_inner.to(inner.dtype), dots.to(weights.dtype), *nones)


def unread_experts(
    experts: nn.Module,
    inner: torch.Tensor,
    top_k_weights: torch.Tensor,
    routing: Routing,
    inverse: torch.Tensor,
    hidden: torch.Tensor,
    *,
    transposed: bool,
    bias: bool,
) -> torch.Tensor:
    """What `roundpipe.model.experts.grouped_experts` returns for ``hidden`` [tokens, H] when
    nothing reads it: zeros, whose backward gives ``inner`` [rows, I] (the gated rows in expert
    order) and ``top_k_weights`` [tokens, k] the full path's gradients (module docstring)."""
    weight, nf4 = weight_form(experts, "down_proj")
    absmax: torch.Tensor | None
    if nf4 is not None:
        down, absmax, meta, compiled = nf4
    else:
        assert weight is not None
        down, absmax, meta, compiled = weight, None, None, False
    how = _DownProduct(meta, compiled, transposed, bool(getattr(experts, "dispatch_products", False)))
    down_bias: torch.Tensor | None = getattr(experts, "down_proj_bias") if bias else None  # noqa: B009
    weights = sort_choices(top_k_weights, routing, inverse)
    args = (inner, weights, hidden, routing.token, routing.offsets, routing.expert, down, absmax, down_bias)
    out: torch.Tensor = _UnreadExperts.apply(*args, how)
    return out
