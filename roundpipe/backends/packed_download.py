"""A forward stage's activations downloaded from a GPU together, into a few pinned pieces.

Why: a forward stage sends down, per microbatch, its output and every activation it saves for the
backward stages (under ``recompute_grain="layer_input"`` every layer's input, and the residuals
saved beside them): tens of tensors, most of one size. Downloaded one by one, each lands in a
pinned allocation of its own, which torch's pinned allocator rounds up to a power of two: a
Qwen3-32B hidden state of 4,096 tokens, 40 MiB, is held as 64 MiB, so a round of its saved inputs
took 14.75 GiB of host memory for 9.2 GiB of values. Laid out together in pieces, as the host's
weight arenas are (`roundpipe.optim.host_room.layout_pieces`: powers of two no larger than what is
left to place, largest tensors first), the rounding adds a few percent. A tensor that appears
several times among them (the rotary tables every layer input carries) is copied once, and the
host values share it as the device values did.

What holds: the values and their structure are those `roundpipe.backends.tensors.download` gives
each value, and the copies are asynchronous on the current stream as there. A piece lives until
every view into it is gone: inputs that different backward stages read keep one piece alive until
the last of them; every one is held until its backward stage anyway, and the round's forward,
when they all are, is the peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from roundpipe.optim.host_room import layout_pieces


def copy_together(values: Sequence[Any], wanted: Callable[[torch.Tensor], bool], pinned: bool) -> list[Any]:
    """``values`` with every ``wanted`` tensor among them copied to the host into pieces per dtype
    (`layout_pieces`; ``pinned``: pinned pieces, copied without blocking), each distinct tensor
    once; the others as they are."""
    found = {id(t): t for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor) and wanted(t)}
    if not found:
        return list(values)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in found.values():
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    copies: dict[int, torch.Tensor] = {}
    for dtype, tensors in by_dtype.items():
        pieces, places = layout_pieces([t.numel() * dtype.itemsize for t in tensors], pinned)
        # Piece sizes and offsets are multiples of 64 bytes, so of every element size.
        memory = [torch.empty(n // dtype.itemsize, dtype=dtype, pin_memory=pinned) for n in pieces]
        for tensor, (piece, offset) in zip(tensors, places, strict=True):
            first = offset // dtype.itemsize
            view = memory[piece][first : first + tensor.numel()].view(tensor.shape)
            view.copy_(tensor, non_blocking=pinned)
            copies[id(tensor)] = view
    return [tree_map(lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t, v) for v in values]


def download_together(values: Sequence[Any]) -> list[Any]:
    """``values`` copied from the GPU to pinned host pieces together (module docstring); values
    already on the host stay as they are, as `roundpipe.backends.tensors.download` leaves them."""
    return copy_together(values, lambda t: t.device.type != "cpu", pinned=True)


__all__ = ["copy_together", "download_together"]
