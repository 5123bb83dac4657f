"""Routed (token, expert) pairs sorted by expert, and the permutations between the two orders.

Why apart from the experts: routing is index work, the same for every experts layout and weight
format. `route` sorts a layer's choices by expert and finds each expert's rows on the device
(no host read). `gather_rows` takes each token's row once per choice, in expert order,
`sort_choices` puts the router's weights in that order, and `unsort_rows` brings the experts'
output rows back to (token, choice) order. All are permutations (with ``k`` copies of each token
for the first), so their gradients are gathers (for the first, then a sum over ``k`` in a fixed
order); autograd's own gradient of an index scatters with accumulation, float atomics on CUDA,
whose rounding changes from run to run and which wait on each other where rows collide.

What holds: the forward values are exactly what indexing gives, and the gradients what autograd's
indexing gives up to the order of the ``k`` additions per token (`tests/test_moe_experts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roundpipe.model import choice_sum


@dataclass(frozen=True)
class Routing:
    """The routed (token, expert) pairs sorted by expert: ``order`` (pair index in sorted order),
    ``token`` (its token row), ``expert`` (its expert id) and ``offsets`` (int32, the end of
    each expert's rows), all on the device."""

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    offsets: torch.Tensor


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the ``[tokens, k]`` choices by expert (stable: ties keep token order)."""
    k = top_k_index.shape[-1]
    expert, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(1, num_experts + 1, device=expert.device, dtype=expert.dtype)
    offsets = torch.searchsorted(expert, bounds, out_int32=True)
    return Routing(order, torch.div(order, k, rounding_mode="floor"), expert, offsets)


class _RowsByExpert(torch.autograd.Function):
    """``hidden[token]``: each token's row once per choice, in expert order. Its gradient sums the
    ``k`` rows of each token through the inverse permutation (a gather, then a sum over ``k`` in a
    fixed order), where autograd's own for indexing scatters with accumulation: float atomics on
    CUDA, whose order, and so whose rounding, changes from run to run."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.tokens = k, hidden.shape[0]
        return hidden[token]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        if choice_sum.in_use(grad):
            return choice_sum.choice_sum(grad, inverse, None, ctx.k), None, None, None
        return grad[inverse].view(ctx.tokens, ctx.k, -1).sum(dim=1), None, None, None


class _Permuted(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` whose inverse is ``undo``: the gradient is the
    gather ``grad[undo]``, not a scatter with accumulation."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, index: torch.Tensor, undo: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(undo)
        return x[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (undo,) = ctx.saved_tensors
        return grad[undo], None, None


def inverse_order(routing: Routing) -> torch.Tensor:
    """The sorted position of every (token, choice) pair: ``inverse[order[j]] = j``."""
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=inverse.device)
    return inverse


def gather_rows(hidden: torch.Tensor, routing: Routing, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """The routed rows of ``hidden`` [tokens, H] sorted by expert (`_RowsByExpert`)."""
    rows: torch.Tensor = _RowsByExpert.apply(hidden, routing.token, inverse, k)
    return rows


def unsort_rows(rows: torch.Tensor, routing: Routing, inverse: torch.Tensor) -> torch.Tensor:
    """``rows`` sorted by expert back in (token, choice) order: ``rows[inverse]``."""
    unsorted: torch.Tensor = _Permuted.apply(rows, inverse, routing.order)
    return unsorted


def sort_choices(values: torch.Tensor, routing: Routing, inverse: torch.Tensor) -> torch.Tensor:
    """``values`` [tokens, k] (the router's weights) flat in expert order: ``values.reshape(-1)[order]``."""
    ordered: torch.Tensor = _Permuted.apply(values.reshape(-1), routing.order, inverse)
    return ordered
