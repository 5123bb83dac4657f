"""The experts' grouped product, direct and as roundpipe::grouped_mm.

Both must give what a loop over the experts gives (values and both gradients, at any widths and
weight strides); the operator must register a fake implementation and a derivative that torch's
operator checks accept, and be what a traced experts layer calls when dispatched, so that
inductor's C++ wrapper calls it through the dispatcher instead of ``aten::_grouped_mm``.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from roundpipe.model.grouped_mm import _grouped_mm_op, _weight_grad_op, grouped_mm


def looped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    rows, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        rows.append(x[start:end] @ weight[e])
        start = end
    return torch.cat(rows)


def case(d_in: int, d_out: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(d_in * 100 + d_out)
    x = torch.randn(40, d_in, generator=gen, dtype=torch.float64).float()
    if transposed:  # stored [E, out, in], used through a transposed view
        weight = torch.randn(4, d_out, d_in, generator=gen).transpose(-2, -1)
    else:
        weight = torch.randn(4, d_in, d_out, generator=gen)
    offsets = torch.tensor([7, 7, 25, 40], dtype=torch.int32)  # one expert gets no rows
    return x, weight, offsets


@pytest.mark.parametrize("dispatched", [False, True], ids=["direct", "operator"])
@pytest.mark.parametrize("d_in,d_out", [(16, 24), (13, 10)], ids=["aligned", "padded"])
@pytest.mark.parametrize("transposed", [False, True], ids=["in-out", "out-in"])
def test_values_and_both_gradients_match_a_loop_over_experts(
    d_in: int, d_out: int, transposed: bool, dispatched: bool
) -> None:
    x, weight, offsets = case(d_in, d_out, transposed)
    x_ref, w_ref = x.clone().requires_grad_(), weight.detach().clone().requires_grad_()
    x_got, w_got = x.clone().requires_grad_(), weight.detach().clone().requires_grad_()
    grad = torch.randn(40, d_out, generator=torch.Generator().manual_seed(3))
    want = looped(x_ref, w_ref, offsets)
    got = grouped_mm(x_got, w_got, offsets, dispatched=dispatched)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x_got.grad, x_ref.grad)
    torch.testing.assert_close(w_got.grad, w_ref.grad)
    assert w_got.grad is not None and w_got.grad[1].abs().sum() == 0  # the expert with no rows


def test_a_frozen_weight_gets_no_gradient_and_keeps_no_input() -> None:
    x, weight, offsets = case(16, 24, False)
    x.requires_grad_()
    out = grouped_mm(x, weight, offsets, dispatched=True)
    saved = (
        [t for t in out.grad_fn.saved_tensors if t is not None]
        if hasattr(out.grad_fn, "saved_tensors")
        else []
    )
    out.sum().backward()
    assert x.grad is not None and weight.grad is None
    assert all(t.data_ptr() != x.data_ptr() for t in saved)


@pytest.mark.parametrize("transposed", [False, True], ids=["in-out", "out-in"])
def test_the_operators_pass_torchs_checks(transposed: bool) -> None:
    x, weight, offsets = case(16, 24, transposed)
    torch.library.opcheck(_grouped_mm_op, (x.requires_grad_(), weight.requires_grad_(), offsets))
    grad = torch.randn(40, 24)
    torch.library.opcheck(_weight_grad_op, (grad, x.detach(), offsets))


@pytest.mark.parametrize("dispatched", [False, True], ids=["direct", "operator"])
def test_a_traced_product_calls_roundpipes_operator_only_when_dispatched(dispatched: bool) -> None:
    """What inductor compiles: dispatched, the traced forward and backward hold roundpipe::grouped_mm
    (the C++ wrapper calls it through the dispatcher) and no aten::_grouped_mm (no shim on torch
    2.11); direct, aten's product as before."""
    x, weight, offsets = case(16, 24, True)

    def step(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = grouped_mm(x, weight, offsets, dispatched=dispatched)
        return torch.autograd.grad(out.square().sum(), (x, weight))

    graph = make_fx(step)(x.requires_grad_(), weight.requires_grad_(), offsets)
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    ours = {"roundpipe.grouped_mm.default", "roundpipe.grouped_mm_weight_grad.default"}
    atens = {t for t in targets if "_grouped_mm" in t and "roundpipe" not in t}
    assert (ours <= targets, bool(atens)) == (dispatched, not dispatched), targets
