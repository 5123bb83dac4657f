"""The experts' grouped matrix product, called directly or as roundpipe's own operator.

Directly (the default): ``torch.nn.functional.grouped_mm`` on tensors made fit for its kernel,
which wants 16-byte strides and base pointers: a dimension that is not a multiple of 16 bytes is
padded with zeros (exact; real models never need it), a misaligned base pointer is copied to a
fresh tensor.

As ``roundpipe::grouped_mm`` (``dispatched=True``), for layers compiled with inductor's C++
wrapper: torch 2.11's C++ wrapper cannot call ``aten::_grouped_mm`` (its CUDA shim header lacks
``aoti_torch_cuda__grouped_mm``), but it calls an operator it does not know through the
dispatcher (``aoti_torch_call_dispatcher``), which needs no shim. Its gradients are the same
operator on the transposed weight (for ``x``) and ``roundpipe::grouped_mm_weight_grad`` (for the
weight, only when it needs one: LoRA's experts are frozen). The operator's body is Python, which
the C++ code calls back for every product. `roundpipe.backends.compiling.LayerCompiler` routes a
layer's experts through it only when the C++ wrapper is on (docs/design.md has the measurements).

Both must never read a tensor's value on the host (the experts issue a whole layer without waiting
for the device) and compute what ``torch.nn.functional.grouped_mm`` computes, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN_BYTES = 16
# torch >= 2.10 names it in torch.nn.functional; 2.9 has only the private op, the same kernel.
_GROUPED_MM: Any = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")  # noqa: B009


def _pad_to(t: Tensor, dim: int, size: int) -> Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, missing]
    return F.pad(t, pads)


def _aligned_size(size: int, element_size: int) -> int:
    step = max(1, ALIGN_BYTES // element_size)
    return -(-size // step) * step


def _aligned_base(t: Tensor) -> Tensor:
    if torch.compiler.is_compiling() or t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _padded_product(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    size = weight.element_size()
    d_in, d_out = weight.shape[1], weight.shape[2]
    p_in, p_out = _aligned_size(d_in, size), _aligned_size(d_out, size)
    if (p_in, p_out) != (d_in, d_out):
        x = _pad_to(x, 1, p_in)
        weight = _pad_to(_pad_to(weight, 1, p_in), 2, p_out)
    out = _GROUPED_MM(_aligned_base(x.contiguous()), _aligned_base(weight), offs=offsets)
    return out[:, :d_out] if p_out != d_out else out


@torch.library.custom_op("roundpipe::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return _padded_product(x, weight, offsets).contiguous()  # the strides its fake promises


@_grouped_mm_op.register_fake
def _grouped_mm_shape(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[2]), dtype=weight.dtype)


@torch.library.custom_op("roundpipe::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(grad: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    """``[E, out, in]``: ``grad[rows of e]^T @ x[rows of e]`` (the weight's gradient, transposed,
    as torch's own derivative of the grouped product computes it)."""
    size = grad.element_size()
    d_in, d_out = x.shape[1], grad.shape[1]
    p_in, p_out = _aligned_size(d_in, size), _aligned_size(d_out, size)
    grad_t = _aligned_base(_pad_to(grad, 1, p_out).contiguous()).t()
    rows = _pad_to(x, 1, p_in).contiguous()
    out = _GROUPED_MM(grad_t, _aligned_base(rows), offs=offsets)
    return out[:, :d_out, :d_in].contiguous() if (p_in, p_out) != (d_in, d_out) else out


@_weight_grad_op.register_fake
def _weight_grad_shape(grad: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    return grad.new_empty((offsets.shape[0], grad.shape[1], x.shape[1]))


def _save(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    x, weight, offsets = inputs
    ctx.save_for_backward(x if weight.requires_grad else None, weight, offsets)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, weight, offsets = ctx.saved_tensors
    grad_x = _grouped_mm_op(grad, weight.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = _weight_grad_op(grad, x, offsets).transpose(-2, -1)  # x: already the weight's dtype
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_backward, setup_context=_save)


def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor, *, dispatched: bool = False) -> Tensor:
    """``x[rows of e] @ weight[e]`` for every expert e: ``x`` [S, in] sorted by expert (cast to the
    weight's dtype), ``weight`` [E, in, out] (any strides), ``offsets`` [E] int32 row ends;
    ``dispatched``: as the operator ``roundpipe::grouped_mm`` (module docstring).

    A compiled product in another dtype than bf16 goes through the operator too: torch's fake
    (meta) ``aten::_grouped_mm`` accepts only bf16, so tracing an fp32 experts layer failed, while
    the eager kernel runs any float dtype on CPU and loops over the experts on CUDA."""
    x = x.to(weight.dtype)
    if dispatched or (weight.dtype != torch.bfloat16 and torch.compiler.is_compiling()):
        return _grouped_mm_op(x, weight, offsets)
    return _padded_product(x, weight, offsets)
