"""NF4 dequantization on CUDA as one hand-written Triton kernel, also inside ``torch.compile``.

Why it exists: a frozen NF4 base is dequantized in every layer call (twice per backward stage), so
the rate of that one step bounds the layer. The same lookup written in torch ops (two gathers, a
stack, a multiply; `roundpipe.model.nf4`) reaches a tenth of a GPU's memory bandwidth, eager or
fused by inductor; this kernel reads each packed byte once and writes both of its elements, so it
is bound by the bf16 bytes it writes.

What holds: the result is bit for bit the torch path's (`roundpipe.model.nf4._dequantize_torch`):
each value is the fp32 code times the fp32 scale of its block, rounded once to the output dtype.
The layout is `roundpipe.model.nf4`'s: two codes per byte, the first element in the high nibble,
one fp32 scale per ``block_size`` elements. Triton is imported on the first launch, never at import
time: this module imports (and `available` answers False) where triton is absent, as on CPU-only
builds of torch. Inside a compiled graph the kernel is the custom op ``roundpipe::nf4_dequantize``,
one opaque node that fills a fresh tensor, so tracing neither breaks nor looks into Triton, and a
compiled backward dequantizes again rather than keeping the forward's dense weight.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from roundpipe.model.nf4_codes import device_table

# The kernel's names resolve in this module's globals when Triton compiles it; `_jit` binds
# ``tl`` on the first launch, so that importing this module costs nothing where Triton is absent.
tl: Any = None

# Packed bytes per program (twice as many elements written) and its warps: 8 bytes a thread.
# At 4 a thread each thread loads one 32-bit word and stores its 8 elements as one 16-byte store
# (the sm_90 PTX of Triton 3.5; other ratios pass the interleaved pair through shared memory), yet
# on an H100 2048 bytes and 8 warps wrote 8-21% faster on every 32B-shaped projection
# (`bench/gpu_nf4.py`'s launch sweep: 1,680 against 1,450 GB/s on gate_proj, 1,925 against 1,750
# on down_proj), the same bits.
BYTES_PER_PROGRAM = 2048
NUM_WARPS = 8

_available: bool | None = None
_jitted: Any = None


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernel can run here: Triton importable and a CUDA device present. Found once,
    and taken as a constant by dynamo (it never traces the probe)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
    return _available


def _nf4_kernel(  # type: ignore[no-untyped-def]
    packed_ptr,
    absmax_ptr,
    codes_ptr,
    out_ptr,
    n_bytes,
    HALF_BLOCK: tl.constexpr,
    BYTES: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """One program: ``BYTES`` packed bytes from ``start`` on, ``2 * BYTES`` elements written.
    Offsets past the first are program-local int32; ``start`` is int64, so weights of more than
    2**31 elements index correctly. A byte's two elements share a block (blocks are even)."""
    start = tl.program_id(0).to(tl.int64) * BYTES
    first_block = start // HALF_BLOCK
    block_offset = (start - first_block * HALF_BLOCK).to(tl.int32)
    left = tl.minimum(n_bytes - start, BYTES).to(tl.int32)
    packed_ptr += start
    out_ptr += 2 * start
    if PAIRED:
        # Each byte loaded once; its two elements joined in order, high nibble first.
        local = tl.arange(0, BYTES)
        inside = local < left
        byte = tl.load(packed_ptr + local, mask=inside, other=0).to(tl.int32)
        scale = tl.load(absmax_ptr + first_block + (block_offset + local) // HALF_BLOCK, mask=inside)
        high = (tl.load(codes_ptr + (byte >> 4)) * scale).to(out_ptr.dtype.element_ty)
        low = (tl.load(codes_ptr + (byte & 15)) * scale).to(out_ptr.dtype.element_ty)
        elements = tl.arange(0, 2 * BYTES)
        tl.store(out_ptr + elements, tl.interleave(high, low), mask=elements < 2 * left)
    else:
        # Each element loads its own byte (the pair's second load hits the cache).
        elements = tl.arange(0, 2 * BYTES)
        inside = elements < 2 * left
        local = elements // 2
        byte = tl.load(packed_ptr + local, mask=inside, other=0).to(tl.int32)
        nibble = (byte >> (4 - 4 * (elements & 1))) & 15
        scale = tl.load(absmax_ptr + first_block + (block_offset + local) // HALF_BLOCK, mask=inside)
        value = tl.load(codes_ptr + nibble) * scale
        tl.store(out_ptr + elements, value.to(out_ptr.dtype.element_ty), mask=inside)


def _jit() -> Any:
    global _jitted, tl
    if _jitted is None:
        import triton
        import triton.language

        tl = triton.language
        _jitted = triton.jit(_nf4_kernel)
    return _jitted


def _code_table(device: torch.device) -> torch.Tensor:
    """The 16 NF4 codes, fp32, on ``device``."""
    return device_table("codes", device, lambda codes: codes)


def _launch(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    *,
    bytes_per_program: int = BYTES_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    paired: bool = True,
) -> torch.Tensor:
    """Fill ``out`` (contiguous, 2 * ``packed.numel()`` elements) with the dequantized weight.
    ``bytes_per_program`` must be a power of two; ``paired`` False loads a byte per element."""
    n_bytes = packed.numel()
    if block_size <= 0 or block_size % 2 or (2 * n_bytes) % block_size:
        raise ValueError(f"{2 * n_bytes} elements are no whole number of blocks of {block_size}")
    if absmax.numel() != 2 * n_bytes // block_size or out.numel() != 2 * n_bytes or not out.is_contiguous():
        raise ValueError(
            f"{n_bytes} packed bytes need {2 * n_bytes // block_size} scales and {2 * n_bytes} "
            f"contiguous outputs, got {absmax.numel()} and {out.numel()}"
        )
    if n_bytes == 0:
        return out
    grid = ((n_bytes + bytes_per_program - 1) // bytes_per_program,)
    # Triton launches on the current device and its current stream: make them the bytes' own.
    with torch.cuda.device(packed.device) if packed.is_cuda else contextlib.nullcontext():
        _jit()[grid](
            packed.contiguous(),
            absmax.contiguous(),
            _code_table(packed.device),
            out,
            n_bytes,
            HALF_BLOCK=block_size // 2,
            BYTES=bytes_per_program,
            PAIRED=paired,
            num_warps=num_warps,
        )
    return out


@torch.library.custom_op("roundpipe::nf4_dequantize", mutates_args=("out",))
def _nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Writes into ``out`` rather than returning a new tensor: calls with the same bytes (the
    forward's and the backward's) then stay two nodes, as their fresh outputs are never merged.
    A pure op would be merged into one, and its dense output kept from forward to backward."""
    _launch(packed, absmax, block_size, out)


@_nf4_dequantize.register_fake
def _(packed: torch.Tensor, absmax: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    return None


def dequantize_nf4_cuda(
    packed: torch.Tensor, absmax: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The flat dequantized tensor [2 * ``packed.numel()``] of ``dtype``, on ``packed``'s device.
    Eager calls launch the kernel directly (no dispatcher round trip); traced calls go through the
    custom op, which a graph holds as one node."""
    out = torch.empty(packed.numel() * 2, dtype=dtype, device=packed.device)
    if torch.compiler.is_compiling():
        torch.ops.roundpipe.nf4_dequantize(packed, absmax, block_size, out)
        return out
    return _launch(packed, absmax, block_size, out)
