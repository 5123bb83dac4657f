"""A token's ``k`` expert output rows summed in one pass, weighted or not: the combine at the end of
a mixture-of-experts layer, and the gradient of the row gather at its start.

Why: both read ``tokens * k`` rows in expert order through the inverse permutation and write one
row per token, which is bound by memory. Inductor fuses the gather, the weighting and the sum into
one kernel, yet on workload D's block (4096 tokens, k = 8, width 2048, bf16) that kernel took 0.20
ms on an H100 and the gather-sum of the backward 0.16 (`gpu_big.sh D16-profile`), where the 150 MB
they move take ~0.05 ms at the card's bandwidth. Here each is one hand-written Triton kernel: a
program per token and block of columns reads its ``k`` rows once and accumulates in fp32; the
backward of the weighted sum writes every row's gradient once (the inverse is a permutation: no
atomics) and the weight's gradient as each row's dot product with the token's gradient, in the
same program.

What holds: the kernels compute `reference`'s value, each product rounded to the rows' dtype as
it rounds them and the ``k`` products added in fp32 (in the order ``0 .. k-1``, where torch's sum
may take another) and rounded once; the gradients likewise, up to the order of their fp32
additions (`tests/test_choice_sum.py` runs the kernels in Triton's interpreter on CPU).
Where Triton or CUDA is absent the custom ops run the reference in torch, so a CPU pipe exercises
the same ops and autograd.

On by default where the rows are on a CUDA device and Triton is present (``ENABLED`` is None:
`in_use`); elsewhere, and wherever ``ENABLED`` is False, the MoE path runs the torch formula
inline. As `torch.library.triton_op`s their launches trace into the compiled layer, for inductor
to issue from its own code. One H100 host, one call each (`gpu_big.sh D-choicesum D`,
`gpu_big.sh D16-choicesum D16`): D 6,889 tok/s against 6,646, its host-bound share 36.1% against
49.3%; D16 (as opaque operators, which inductor's C++ wrapper calls back through Python) 13,955
against 13,183.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from roundpipe.model import nf4_triton

# None: the kernels where `in_use` finds CUDA and Triton; True or False forces the choice (the
# benchmarks' ``--choice-sum on|off``). Read at trace time.
ENABLED: bool | None = None

# Columns per program: one 16-byte load per thread of 4 warps in bf16.
BLOCK = 1024
NUM_WARPS = 4

tl: Any = None
_kernels: dict[str, Any] = {}

# Triton importable and a CUDA device present, found once: the NF4 kernel's own check.
available = nf4_triton.available


def reference(
    rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, k: int
) -> torch.Tensor:
    """``rows`` [tokens * k, H] in expert order summed per token [tokens, H]: the torch formula
    `roundpipe.model.experts.grouped_experts` runs while ``ENABLED`` is off."""
    picked = rows[inverse]
    if weights is not None:
        picked = picked * weights.reshape(-1, 1).to(rows.dtype)
    return picked.view(-1, k, rows.shape[-1]).sum(dim=1)


def _sum_kernel(
    rows_ptr,
    inverse_ptr,
    weights_ptr,
    out_ptr,
    WIDTH: tl.constexpr,
    K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # type: ignore[no-untyped-def]
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < WIDTH
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for choice in tl.static_range(K):
        row = tl.load(inverse_ptr + token * K + choice).to(tl.int64)
        value = tl.load(rows_ptr + row * WIDTH + cols, mask=inside)
        if WEIGHTED:
            weight = tl.load(weights_ptr + token * K + choice).to(tl.float32)
            # Rounded as the reference rounds: the weight, then the product, to the rows' dtype.
            weight = weight.to(rows_ptr.dtype.element_ty).to(tl.float32)
            value = (value.to(tl.float32) * weight).to(rows_ptr.dtype.element_ty)
        total += value.to(tl.float32)
    tl.store(out_ptr + token * WIDTH + cols, total.to(out_ptr.dtype.element_ty), mask=inside)


def _sum_backward_kernel(
    grad_ptr,
    rows_ptr,
    inverse_ptr,
    weights_ptr,
    grad_rows_ptr,
    grad_weights_ptr,
    WIDTH: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):  # type: ignore[no-untyped-def]
    token = tl.program_id(0).to(tl.int64)
    for choice in tl.static_range(K):
        row = tl.load(inverse_ptr + token * K + choice).to(tl.int64)
        weight = tl.load(weights_ptr + token * K + choice).to(tl.float32)
        weight = weight.to(rows_ptr.dtype.element_ty).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, WIDTH, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < WIDTH
            grad = tl.load(grad_ptr + token * WIDTH + cols, mask=inside, other=0.0).to(tl.float32)
            scaled = (grad * weight).to(grad_rows_ptr.dtype.element_ty)
            tl.store(grad_rows_ptr + row * WIDTH + cols, scaled, mask=inside)
            value = tl.load(rows_ptr + row * WIDTH + cols, mask=inside, other=0.0).to(tl.float32)
            dot += (grad * value).to(rows_ptr.dtype.element_ty).to(tl.float32)
        tl.store(grad_weights_ptr + token * K + choice, tl.sum(dot, axis=0))


def _jit(name: str) -> Any:
    """The kernel ``name``, compiled by Triton on first use (importing this module costs nothing
    where Triton is absent); under ``TRITON_INTERPRET=1`` the interpreter's."""
    global tl
    if name not in _kernels:
        import triton
        import triton.language

        tl = triton.language
        kernel = triton.jit({"sum": _sum_kernel, "backward": _sum_backward_kernel}[name])
        # Wrapped, the launch traces into a compiled layer's graph (the ops are `triton_op`s), and
        # inductor issues it from its own code: no Python op call per launch from the C++ wrapper.
        _kernels[name] = torch.library.wrap_triton(kernel)
    return _kernels[name]


def _device(t: torch.Tensor) -> Any:
    # Triton launches on the current device and stream: make them the tensor's own.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def launch_sum(
    rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, k: int
) -> torch.Tensor:
    """The sum by the Triton kernel (`reference`'s value)."""
    rows, inverse = rows.contiguous(), inverse.contiguous()
    tokens, width = rows.shape[0] // k, rows.shape[1]
    out = rows.new_empty(tokens, width)
    if tokens == 0:
        return out
    flat = inverse if weights is None else weights.contiguous()
    with _device(rows):
        _jit("sum")[(tokens, -(-width // BLOCK))](
            rows,
            inverse,
            flat,
            out,
            WIDTH=width,
            K=k,
            WEIGHTED=weights is not None,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return out


def launch_backward(
    grad: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted sum's gradients by the Triton kernel: (the rows' in expert order, the weights'
    [tokens, k])."""
    grad, rows, inverse, weights = (
        grad.contiguous(),
        rows.contiguous(),
        inverse.contiguous(),
        weights.contiguous(),
    )
    tokens, width = grad.shape
    grad_rows, grad_weights = rows.new_empty(rows.shape), weights.new_empty(weights.shape)
    if tokens == 0:
        return grad_rows, grad_weights
    with _device(rows):
        _jit("backward")[(tokens,)](
            grad,
            rows,
            inverse,
            weights,
            grad_rows,
            grad_weights,
            WIDTH=width,
            K=k,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return grad_rows, grad_weights


def _spread(grad: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's gradient row once per choice, in (token, choice) order."""
    return grad.unsqueeze(1).expand(-1, k, -1).reshape(-1, grad.shape[-1]).to(dtype)


def _reference_backward(
    grad: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch_backward`'s values in torch ops: the reference's autograd, each row written once by
    index (``inverse`` is a permutation)."""
    spread = _spread(grad, k, rows.dtype)
    grad_rows = torch.empty_like(rows).index_copy_(0, inverse, spread * weights.reshape(-1, 1).to(rows.dtype))
    grad_weights = (spread * rows[inverse]).sum(dim=-1).view(weights.shape).to(weights.dtype)
    return grad_rows, grad_weights


def _kernels_here(t: torch.Tensor) -> bool:
    return t.is_cuda and available()


def in_use(t: torch.Tensor) -> bool:
    """Whether the MoE path sums the choices of ``t``'s rows through these ops: ``ENABLED`` when
    set, else where the kernels run (a CUDA tensor, Triton importable)."""
    return _kernels_here(t) if ENABLED is None else ENABLED


# Two ops, not one with an optional weight, so that no argument may be None. Each is a
# `triton_op`: under torch.compile its body traces into the layer's graph, the torch formula on
# CPU (fused by inductor like any other) and the wrapped kernel launch on CUDA; its body is also
# its fake implementation.
@torch.library.triton_op("roundpipe::choice_sum", mutates_args=())
def _choice_sum(rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    if _kernels_here(rows):
        return launch_sum(rows, inverse, weights, k)
    return reference(rows, inverse, weights, k)


@torch.library.triton_op("roundpipe::gather_sum", mutates_args=())
def _gather_sum(rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    if _kernels_here(rows):
        return launch_sum(rows, inverse, None, k)
    return reference(rows, inverse, None, k)


@torch.library.triton_op("roundpipe::choice_sum_backward", mutates_args=())
def _choice_sum_backward(
    grad: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if _kernels_here(rows):
        return launch_backward(grad, rows, inverse, weights, k)
    return _reference_backward(grad, rows, inverse, weights, k)


def _setup_weighted(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    rows, inverse, weights, ctx.k = inputs
    ctx.save_for_backward(rows, inverse, weights)


def _backward_weighted(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor, None]:
    rows, inverse, weights = ctx.saved_tensors
    grad_rows, grad_weights = torch.ops.roundpipe.choice_sum_backward(grad, rows, inverse, weights, ctx.k)
    return grad_rows, None, grad_weights, None


def _setup_gather(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    rows, inverse, ctx.k = inputs
    ctx.rows_dtype = rows.dtype  # the rows' values are not read again
    ctx.save_for_backward(inverse)


def _backward_gather(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    """Each row its token's gradient, written once by index (``inverse`` is a permutation)."""
    (inverse,) = ctx.saved_tensors
    spread = _spread(grad, ctx.k, ctx.rows_dtype)
    return torch.empty_like(spread).index_copy_(0, inverse, spread), None, None


_choice_sum.register_autograd(_backward_weighted, setup_context=_setup_weighted)
_gather_sum.register_autograd(_backward_gather, setup_context=_setup_gather)


def choice_sum(
    rows: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, k: int
) -> torch.Tensor:
    """``rows`` [tokens * k, H] sorted by expert, summed per token through ``inverse`` (the sorted
    position of each (token, choice) pair), each row times its ``weights`` [tokens, k] entry
    where given: `reference`'s value, by the Triton kernel on CUDA."""
    if weights is None:
        gathered: torch.Tensor = torch.ops.roundpipe.gather_sum(rows, inverse, k)
        return gathered
    out: torch.Tensor = torch.ops.roundpipe.choice_sum(rows, inverse, weights, k)
    return out
