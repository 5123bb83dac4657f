"""The host's compute copies laid out in arenas, and whether the host has room for them.

Why arenas: the compute copies a run must make (frozen weights not already in the run's precision,
or not pinned where a GPU reads them; every trainable parameter's) are laid out layer by layer in
few large allocations per dtype rather than one per tensor.

Why pieces, on CUDA: torch's pinned allocator rounds every allocation up to a power of two before
it pins it (``CachingHostAllocator``: ``PowerOf2Ceil``), and pinned pages are resident. One arena
of a 70B base's 35 GB of 4-bit bytes would pin 64 GiB. So a pinned arena is cut into pieces of at
most `PIECE_BYTES`, each a power of two no larger than what is left to place, filled with whole
tensors, largest first, each into the first piece with room (`layout_pieces`): what the rounding
adds is the room no remaining tensor fitted, a few percent on the model shapes tested
(tests/test_host_room.py). Unpinned arenas (CPU workers) are one allocation each, which nothing rounds.

Why the room check: a model whose copies the host lacks fails inside torch (a pinned allocation)
or, pageable, is ended later by the kernel's out-of-memory killer, with nothing said and the run
lost. So the bytes are counted before any is allocated, as the allocator will hold them (pinned
pieces rounded), with the fp32 optimizer copies and gradient buffers of trainable parameters, and
compared with what the kernel says it can give (``MemAvailable``: free memory plus page cache it
can reclaim, which holds memory-mapped checkpoint shards). A run that cannot fit stops with the
count and what to change.

What holds: the check reads no tensor's values, and where the kernel does not say what is
available (no ``/proc/meminfo``) it passes: it never refuses a run on a guess. Only what is certain
is counted: the optimizer's own state (AdamW: 8 bytes a trainable parameter) is allocated at its
first step and is not, though the message names it. Every view handed out is 64-byte aligned.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from roundpipe.errors import HostMemoryError
from roundpipe.plan.sizes import format_bytes

MEMINFO = "/proc/meminfo"
SHORT_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "4-bit (uint8)",
}
PIECE_BYTES = 1 << 32  # the largest pinned piece: 4 GiB, so the last piece's rounding stays small
ALIGN_BYTES = 64


def available_host_bytes(meminfo: str = MEMINFO) -> int | None:
    """What the kernel says it can give without swapping (``MemAvailable``), None where unknown."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def pinned_bytes(request: int) -> int:
    """What torch's pinned allocator holds for a request of ``request`` bytes: the power of two at
    or above it."""
    return 0 if request <= 0 else 1 << (request - 1).bit_length()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def layout_pieces(sizes: Sequence[int], pinned: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The pieces of one dtype's arena (bytes to request) and where each tensor of ``sizes``
    (bytes) lies in them: (piece, byte offset). Unpinned: one piece, in order. Pinned: largest
    tensors first, each into the first piece with room for it, or a new piece of the power of two
    at or below the bytes not yet placed (at most `PIECE_BYTES`; a tensor larger than that alone)."""
    aligned = [_aligned(n) for n in sizes]
    if not pinned:
        offsets = [0, *itertools.accumulate(aligned)]
        return [offsets[-1]], [(0, offset) for offset in offsets[:-1]]
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    capacity: list[int] = []
    used: list[int] = []
    left = sum(aligned)
    for index in sorted(range(len(sizes)), key=lambda i: -aligned[i]):
        size = aligned[index]
        piece = next((p for p, room in enumerate(capacity) if used[p] + size <= room), len(used))
        if piece == len(used):
            capacity.append(max(size, min(PIECE_BYTES, 1 << (left.bit_length() - 1))))
            used.append(0)
        places[index] = (piece, used[piece])
        used[piece] += size
        left -= size
    return used, places


@dataclass(frozen=True)
class HostCopies:
    """Bytes the host copies take as allocated: compute copies by dtype name (pinned pieces as the
    pinned allocator rounds them), fp32 optimizer copies, fp32 gradient buffers; and what they copy."""

    compute: dict[str, int] = field(default_factory=dict)
    masters: int = 0
    gradients: int = 0
    pinned: bool = False
    frozen_copied: int = 0  # bytes of the compute copies that copy frozen weights

    @property
    def total(self) -> int:
        return sum(self.compute.values()) + self.masters + self.gradients

    def describe(self) -> str:
        pinned = ", pinned for the GPU" if self.pinned else ""
        parts = [
            f"{dtype} compute copies {format_bytes(n)}{pinned}" for dtype, n in self.compute.items() if n
        ]
        if self.masters:
            parts.append(f"fp32 optimizer copies {format_bytes(self.masters)}")
        if self.gradients:
            parts.append(f"fp32 gradient buffers {format_bytes(self.gradients)}")
        return "; ".join(parts)


class Arenas:
    """The compute copies of ``made`` (in order), per dtype in pieces (`layout_pieces`), allocated
    once the host is known to have room for them and for the trainable parameters' fp32 copies and
    gradient buffers (`check_host_room`); `view` gives a parameter's place."""

    def __init__(
        self,
        made: Sequence[nn.Parameter],
        layer_params: Iterable[Iterable[tuple[str, nn.Parameter]]],
        compute_dtype: Callable[[torch.Tensor], torch.dtype],
        pinned: bool,
    ) -> None:
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in made:
            by_dtype.setdefault(compute_dtype(param), []).append(param)
        self._places: dict[int, tuple[torch.dtype, int, int]] = {}
        layouts: dict[torch.dtype, list[int]] = {}
        for dtype, params in by_dtype.items():
            pieces, places = layout_pieces([p.numel() * dtype.itemsize for p in params], pinned)
            layouts[dtype] = pieces
            for param, (piece, offset) in zip(params, places, strict=True):
                self._places[id(param)] = (dtype, piece, offset)
        check_host_room(_count(made, layer_params, layouts, compute_dtype, pinned), available_host_bytes())
        self._pieces = {  # piece sizes are multiples of 64 bytes, so of every element size
            dtype: [torch.empty(n // dtype.itemsize, dtype=dtype, pin_memory=pinned) for n in pieces]
            for dtype, pieces in layouts.items()
        }

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The compute copy's place of ``param`` (uninitialised until the caller fills it)."""
        dtype, piece, offset = self._places[id(param)]
        first = offset // dtype.itemsize
        return self._pieces[dtype][piece][first : first + param.numel()].view(param.shape)


def _count(
    made: Sequence[nn.Parameter],
    layer_params: Iterable[Iterable[tuple[str, nn.Parameter]]],
    layouts: dict[torch.dtype, list[int]],
    compute_dtype: Callable[[torch.Tensor], torch.dtype],
    pinned: bool,
) -> HostCopies:
    """What the arenas of ``layouts`` hold as allocated, and the fp32 optimizer copy of each
    trainable parameter of ``made`` that is not one already, and an fp32 gradient buffer (pinned:
    rounded) per layer that holds a trainable parameter."""
    held = pinned_bytes if pinned else (lambda n: n)
    compute = {SHORT_NAMES.get(d, str(d)): sum(held(n) for n in pieces) for d, pieces in layouts.items()}
    frozen = sum(p.numel() * compute_dtype(p).itemsize for p in made if not p.requires_grad)
    masters = sum(
        p.numel() * 4
        for p in made
        if p.requires_grad and not (p.dtype == torch.float32 and p.device.type == "cpu")
    )
    trainable = [p for named in layer_params for _, p in named if p.requires_grad]
    gradients = sum(held(p.numel() * 4) for p in trainable)
    return HostCopies(compute, masters, gradients, pinned, frozen)


def check_host_room(copies: HostCopies, available: int | None) -> None:
    """Raise `HostMemoryError` when ``copies`` need more than ``available`` host bytes."""
    if available is None or copies.total <= available:
        return
    fixes = []
    if copies.frozen_copied:
        fixes.append(
            "hold the frozen base in 4 bits (RunConfig(base_format='nf4'), `roundpipe train "
            "--base-format nf4`: a quarter of its bf16 bytes)"
        )
        fixes.append(
            "load the model in the run's precision (from_pretrained(..., dtype=torch.bfloat16) with "
            "precision='bf16'), or from a directory with `roundpipe train --model DIR`, which maps "
            "its shards instead of keeping a private copy beside the compute copy"
        )
    if copies.masters + copies.gradients >= copies.total // 10:  # the trainable weights' copies weigh
        fixes.append(
            "train LoRA adapters rather than every weight (each trainable parameter adds an fp32 "
            "optimizer copy and gradient buffer here, and AdamW's state, 8 bytes, at its first step)"
        )
    fixes.append("free host memory that other processes hold")
    raise HostMemoryError(
        f"roundpipe's host copies of the model need {format_bytes(copies.total)} ({copies.describe()}), "
        f"but the host has {format_bytes(available)} available (MemAvailable in {MEMINFO}); "
        "allocating them would fail or end the process. To fit: " + "; or ".join(fixes)
    )
