"""The Triton NF4 kernel (`roundpipe.model.nf4_triton`): bit for bit the torch path's result, one
node of a compiled graph with no break, and a compiled backward that keeps no dense weight.

The GPU tests run the kernel itself. The CPU tests run everything around it (the dispatch in
`roundpipe.model.nf4`, the custom op under dynamo and aot autograd) with the launch replaced by
the torch path, so they hold where Triton is absent."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from roundpipe.model import nf4, nf4_triton
from roundpipe.model.quant import NF4Linear, NF4Weight, dequantize_nf4, quantize_nf4

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
needs_kernel = pytest.mark.skipif(not nf4_triton.available(), reason="needs Triton and CUDA")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def random_nf4(numel: int, block: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value, and scales over many binades (zero included), as a checkpoint may hold."""
    gen = torch.Generator().manual_seed(numel + block)
    packed = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, generator=gen)
    absmax = torch.exp2(torch.randint(-40, 40, (numel // block,), generator=gen).float())
    absmax *= torch.rand(numel // block, generator=gen) + 0.5
    absmax[:1] = 0
    return packed.to(device), absmax.to(device)


def dense_saved(saved: list[Any], layer: NF4Linear) -> list[Any]:
    """The floating-point tensors in ``saved`` as large as the layer's dense weight."""
    size = layer.out_features * layer.in_features
    return [s for s in saved if s[1].is_floating_point and math.prod(s[0]) >= size]


def compiled_layer_run(layer: NF4Linear, x: torch.Tensor, backend: str) -> tuple[Any, Any, list[Any]]:
    """(the graph count and breaks dynamo finds, the compiled input gradient, the (shape, dtype)
    of every tensor the compiled forward saves for backward)."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(layer(x)).sum()

    explained = torch._dynamo.explain(loss)(x)
    torch._dynamo.reset()
    saved: list[Any] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.compile(loss, fullgraph=True, backend=backend)(x)
    (grad,) = torch.autograd.grad(out, x)
    return (explained.graph_count, explained.graph_break_count), grad, saved


def test_cpu_stays_on_the_torch_path() -> None:
    assert nf4_triton.available() is nf4_triton.available()
    q = quantize_nf4(torch.randn(64, 96))
    assert not nf4._triton_serves(q.packed)
    expected = nf4._dequantize_torch(q.packed, q.absmax, 64, torch.bfloat16).view(64, 96)
    assert same_bits(dequantize_nf4(q, torch.bfloat16), expected)


def test_the_custom_op_is_one_node_and_the_compiled_backward_dequantizes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's path on CPU, its launch filled by the torch path: no graph break, a gradient
    equal to eager's, the op run in forward and again in backward, and no dense weight saved (a
    pure op would be merged with the backward's and its output kept)."""
    launches: list[int] = []

    def torch_launch(
        packed: torch.Tensor, absmax: torch.Tensor, block: int, out: torch.Tensor
    ) -> torch.Tensor:
        launches.append(packed.numel())
        return out.copy_(nf4._dequantize_torch(packed, absmax, block, out.dtype))

    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(256, 128, bias=True).requires_grad_(False))
    x = torch.randn(8, 256, requires_grad=True)
    (eager_grad,) = torch.autograd.grad(torch.nn.functional.silu(layer(x)).sum(), x)
    monkeypatch.setattr(nf4, "_triton_serves", lambda packed: True)
    monkeypatch.setattr(nf4_triton, "_launch", torch_launch)
    graphs, grad, saved = compiled_layer_run(layer, x, "aot_eager")
    assert graphs == (1, 0)
    torch.testing.assert_close(grad, eager_grad)
    assert launches[-2:] == [128 * 256 // 2] * 2
    assert not dense_saved(saved, layer)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "numel, block", [(64 * 3, 64), (4096 * 4096 + 64 * 5, 64), (128 * 7, 128), (1024 * 1024 + 128 * 3, 128)]
)
def test_kernel_equals_the_torch_path_bit_for_bit(numel: int, block: int, dtype: torch.dtype) -> None:
    packed, absmax = random_nf4(numel, block, "cuda")
    expected = nf4._dequantize_torch(packed, absmax, block, dtype)
    assert same_bits(nf4_triton.dequantize_nf4_cuda(packed, absmax, block, dtype), expected)
    weight = NF4Weight(packed, absmax, torch.Size([numel]), dtype, block)
    assert same_bits(dequantize_nf4(weight), expected)  # what the layers call


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize(
    "config",
    [{"bytes_per_program": 512, "num_warps": 4}, {"bytes_per_program": 1024}, {"paired": False}],
)
def test_every_launch_shape_gives_the_same_bits(config: dict[str, Any]) -> None:
    packed, absmax = random_nf4(3 * 4096 + 64 * 5, 64, "cuda")
    out = torch.empty(packed.numel() * 2, dtype=torch.bfloat16, device="cuda")
    nf4_triton._launch(packed, absmax, 64, out, **config)
    assert same_bits(out, nf4._dequantize_torch(packed, absmax, 64, torch.bfloat16))


@pytest.mark.gpu
@needs_kernel
def test_dequantize_nf4_compiles_into_one_graph_with_the_kernels_bits() -> None:
    q = quantize_nf4(torch.randn(512, 256, device="cuda", dtype=torch.bfloat16))

    def dense(packed: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        return dequantize_nf4(NF4Weight(packed, absmax, q.shape, q.dtype, q.block_size)) * 2

    explained = torch._dynamo.explain(dense)(q.packed, q.absmax)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(dense, fullgraph=True)(q.packed, q.absmax)
    expected = nf4._dequantize_torch(q.packed, q.absmax, 64, torch.bfloat16).view(q.shape) * 2
    assert same_bits(compiled, expected)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_linear_on_cuda_matches_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Forward and backward, eager and compiled (inductor): the same numbers as with the torch
    dequantization, and a compiled forward that saves the 4-bit bytes, not the dense weight."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 384, bias=True).requires_grad_(False)
    layer = NF4Linear.from_linear(linear).to("cuda", dtype)
    x = torch.randn(16, 512, device="cuda", dtype=dtype, requires_grad=True)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = layer(x)
        (grad,) = torch.autograd.grad(torch.nn.functional.silu(out).float().sum(), x)
        return out, grad

    kernel_out, kernel_grad = run()
    with monkeypatch.context() as patched:
        patched.setattr(nf4, "_triton_serves", lambda packed: False)
        torch_out, torch_grad = run()
    assert same_bits(kernel_out, torch_out) and same_bits(kernel_grad, torch_grad)
    graphs, grad, saved = compiled_layer_run(layer, x, "inductor")
    assert graphs == (1, 0)
    torch.testing.assert_close(grad, torch_grad)
    assert not dense_saved(saved, layer)
