"""The 4-bit NormalFloat (NF4) format: its code book, quantization and dequantization.

Why it exists apart from `roundpipe.model.quant`: every module that holds NF4 weights reads the
format from here: `NF4Linear` and the frozen-model pass in `roundpipe.model.quant`, the experts'
grouped products in `roundpipe.model.experts`; the pass in turn quantizes experts, so the format
must sit below both. The layout is the one bitsandbytes uses for ``quant_type="nf4"``: the weight
flattened row-major, two codes per byte with the first element in the high nibble, and the
absolute maximum of each block of 64 as its fp32 scale, so the same bytes mean the same weights.
On CUDA the bytes are dequantized by the Triton kernel of `roundpipe.model.nf4_triton`, which
writes the bits of this module's torch path (the reference, and the path everywhere else).

This module must never hold a model, a module, or a dequantized tensor beyond the call that made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roundpipe.errors import ModelError
from roundpipe.model import nf4_triton
from roundpipe.model.nf4_codes import NF4_CODES as NF4_CODES
from roundpipe.model.nf4_codes import device_table

DEFAULT_BLOCK_SIZE = 64


# Elements dequantized per pass in eager mode: bounds the fp32 scratch beside the output.
_EAGER_CHUNK = 1 << 24


@dataclass(frozen=True)
class NF4Weight:
    """A quantized tensor: ``packed`` uint8 [numel / 2] (first element in the high nibble),
    ``absmax`` fp32 [numel / block_size], the ``shape`` and ``dtype`` to dequantize to."""

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def numel(self) -> int:
        return self.packed.numel() * 2

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed codes and the block scales."""
        return self.packed.numel() + self.absmax.numel() * 4


def _codes(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODES, dtype=torch.float32, device=device)


def check_quantizable(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, block_size: int) -> None:
    """Refuse what NF4 cannot hold: a block size that is not a positive even number (two codes share
    a byte), a tensor whose element count is not a whole number of blocks (every block has its
    own scale; a ragged last block would need a second layout), a non-floating tensor."""
    if block_size <= 0 or block_size % 2:
        raise ModelError(f"NF4 block size must be a positive even number, got {block_size}")
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0 or numel % block_size:
        raise ModelError(
            f"cannot quantize a tensor of shape {tuple(shape)} ({numel} elements) to NF4: its element "
            f"count must be a positive multiple of the block size {block_size}; leave it unquantized "
            "or pick a block size that divides it"
        )
    if not dtype.is_floating_point:
        raise ModelError(f"only floating-point tensors can be quantized to NF4, got {dtype}")


# Elements quantized per pass: the fp32 and int64 scratch of one pass (~20 bytes an element) stays
# near 40 MB however large the weight (a 70B model's MLP matrix has 235M elements), so quantizing
# while a checkpoint loads holds little more than the bytes it keeps.
QUANT_CHUNK = 1 << 21


@torch.no_grad()
def quantize_nf4(weight: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE) -> NF4Weight:
    """``weight`` in NF4, on its own device: each element scaled by the reciprocal of its block's
    absolute maximum and given the nearest code (a value exactly between two codes takes the
    lower one, as bitsandbytes does). A block of zeros has scale 0 and dequantizes to zeros.
    Blocks run along the flattened weight, so it is quantized `QUANT_CHUNK` elements at a time
    into outputs laid out first (the pieces' scratch never lands between kept bytes)."""
    check_quantizable(weight.shape, weight.dtype, block_size)
    flat = weight.detach().reshape(-1)
    step = max(block_size, QUANT_CHUNK // block_size * block_size)
    if flat.numel() <= step:
        packed, absmax = _quantize_flat(flat, block_size)
    else:
        packed = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=flat.device)
        absmax = torch.empty(flat.numel() // block_size, dtype=torch.float32, device=flat.device)
        for start in range(0, flat.numel(), step):
            part_packed, part_absmax = _quantize_flat(flat[start : start + step], block_size)
            packed[start // 2 : start // 2 + part_packed.numel()].copy_(part_packed)
            absmax[start // block_size : start // block_size + part_absmax.numel()].copy_(part_absmax)
            del part_packed, part_absmax
    return NF4Weight(packed, absmax, weight.shape, weight.dtype, block_size)


def _quantize_flat(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The core of `quantize_nf4` on whole blocks: the packed codes and the block scales."""
    blocks = flat.reshape(-1, block_size).to(torch.float32)
    absmax = blocks.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    codes = _codes(flat.device)
    midpoints = (codes[1:] + codes[:-1]) / 2
    index = torch.bucketize(blocks * inverse[:, None], midpoints).to(torch.uint8).view(-1, 2)
    packed = (index[:, 0] << 4) | index[:, 1]
    return packed.contiguous(), absmax.contiguous()


def _byte_pairs(codes: torch.Tensor) -> torch.Tensor:
    every = torch.arange(256)
    return torch.stack((codes[every >> 4], codes[every & 15]), dim=1)


def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two code values each byte holds (high nibble first), on ``device``."""
    return device_table("byte_pairs", device, _byte_pairs)


def _triton_serves(packed: torch.Tensor) -> bool:
    """Whether `roundpipe.model.nf4_triton`'s kernel dequantizes ``packed``: CUDA bytes, where
    Triton is present. It writes the torch path's exact bits at memory speed."""
    return packed.is_cuda and nf4_triton.available()


def _dequantize_torch(
    packed: torch.Tensor, absmax: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The core in torch ops, on any device, and the reference the CUDA kernel is held to: codes
    times their block's scale, in fp32, rounded once to ``dtype``.

    Inside a compiled graph the code book is a constant of the graph and each nibble is looked up
    in it: the per-device table cache is a side effect that dynamo cannot carry out of the
    autograd function this runs in (tracing would fail and the whole layer would run eagerly)."""
    if torch.compiler.is_compiling():
        codes = torch.tensor(NF4_CODES, dtype=torch.float32, device=packed.device)
        pairs = (codes[(packed >> 4).long()], codes[(packed & 15).long()])
        return (torch.stack(pairs, dim=-1).view(-1, block_size) * absmax[:, None]).to(dtype).view(-1)
    values = _byte_table(packed.device)[packed.to(torch.int32)].view(-1, block_size)
    return (values * absmax[:, None]).to(dtype).view(-1)


_compiled_core: Any = None


def _compiled_dequantize() -> Any:
    global _compiled_core
    if _compiled_core is None:
        _compiled_core = torch.compile(_dequantize_torch, dynamic=False)
    return _compiled_core


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype | None = None, *, compiled: bool = False) -> torch.Tensor:
    """``q`` as a dense tensor of ``dtype`` (default: the quantized tensor's own) on the device of
    its bytes. Where the Triton kernel serves (CUDA), it writes the whole tensor in one launch,
    with no scratch, ``compiled`` or not. Otherwise eager mode works through chunks of blocks so
    its fp32 scratch stays small, and ``compiled`` runs one fused ``torch.compile`` kernel
    (compiled once per shape)."""
    target = dtype or q.dtype
    if _triton_serves(q.packed):
        return nf4_triton.dequantize_nf4_cuda(q.packed, q.absmax, q.block_size, target).view(q.shape)
    if compiled:
        return _compiled_dequantize()(q.packed, q.absmax, q.block_size, target).view(q.shape)
    out = torch.empty(q.numel, dtype=target, device=q.packed.device)
    step = max(q.block_size, _EAGER_CHUNK // q.block_size * q.block_size)
    for first in range(0, q.numel, step):
        last = min(q.numel, first + step)
        out[first:last] = _dequantize_torch(
            q.packed[first // 2 : last // 2],
            q.absmax[first // q.block_size : last // q.block_size],
            q.block_size,
            target,
        )
    return out.view(q.shape)
