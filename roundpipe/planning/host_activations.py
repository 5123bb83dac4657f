"""Whether the host has room for the activations that one round of a plan saves there.

Why: a forward stage saves the input of every backward stage (with ``recompute_grain=
"layer_input"``, of every layer of one) to host memory, for each microbatch of a round, until that
backward stage reads it again: one 262,144-token sequence of an 8B shape saves 32 inputs of 2 GiB.
A host that lacks them ends the process at the first forward's downloads (the kernel's
out-of-memory killer), with nothing said, after the profile and the plan were made. So the plan's
first use counts them, as the downloads will hold them (from a GPU each forward stage's lands in a
few pinned pieces, which torch rounds up to a power of two: `roundpipe.backends.packed_download`),
and compares them with what the kernel says
is available (`roundpipe.optim.host_room.available_host_bytes`): past it, `HostMemoryError` says
how much, where from, and what to change.

What holds: the count is a lower bound, so the check never refuses a run that could fit: one
round's microbatches (never two iterations' at once), the tensors each activation carries beside
its hidden state (rotary tables, masks) left out. It runs before the first iteration, while the
host holds no activation; unknown availability passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roundpipe.errors import HostMemoryError
from roundpipe.optim.host_room import MEMINFO, available_host_bytes, layout_pieces, pinned_bytes
from roundpipe.plan.memory import (
    Grain,
    LayerMemory,
    input_sender,
    residual_sender,
    saved_inputs,
    saved_residuals,
)
from roundpipe.plan.sizes import format_bytes


def saved_activation_bytes(
    slots: Sequence[Any], memory: LayerMemory, grain: Grain, microbatches: int, pinned: bool
) -> tuple[int, int]:
    """(bytes, downloads) a round of ``microbatches`` saves on the host under ``slots``: each saved
    layer input's own bytes, and the residual saved beside a backward layer's (layer_input). Pinned,
    as the downloads hold them: each forward stage's laid out together in pinned pieces
    (`roundpipe.backends.packed_download`), which the pinned allocator rounds up. Layer 0's input
    is the data, held anyway."""
    forward = [s.layers for s in slots if s.kind == "fwd"]
    by_stage: dict[int | None, list[int]] = {}  # forward stage (None: none) -> the bytes it downloads
    for j in sorted(j for j in saved_inputs(slots, grain) if j > 0):
        nbytes = memory.boundary_bytes[j] - memory.carried_bytes[j]
        by_stage.setdefault(input_sender(forward, j), []).append(nbytes)
    for j in sorted(saved_residuals(slots, grain, True)):
        if memory.residual_bytes[j]:
            by_stage.setdefault(residual_sender(forward, j), []).append(memory.residual_bytes[j])
    sizes = [n for stage in by_stage.values() for n in stage]
    if not pinned:
        return sum(sizes) * microbatches, len(sizes) * microbatches
    held = 0
    for stage, stage_sizes in by_stage.items():
        pieces = layout_pieces(stage_sizes, True)[0] if stage is not None else stage_sizes
        held += sum(pinned_bytes(n) for n in pieces)
    return held * microbatches, len(sizes) * microbatches


def check_activation_room(
    slots: Sequence[Any],
    memory: LayerMemory,
    grain: Grain,
    microbatches: int,
    pinned: bool,
    available: int | None = None,
) -> None:
    """Raise `HostMemoryError` when one round's saved activations exceed the host's available
    memory (``available``, else what the kernel says)."""
    nbytes, count = saved_activation_bytes(slots, memory, grain, microbatches, pinned)
    available = available_host_bytes() if available is None else available
    if available is None or nbytes <= available:
        return
    fixes = ["shorter sequences or fewer tokens per microbatch"]
    if grain == "layer_input":
        fixes.insert(0, "recompute_grain='stage' (only each backward stage's input is saved)")
        if any(memory.residual_bytes):
            fixes.insert(
                0, "save_residuals=False (each layer's input without its residual; --no-save-residuals)"
            )
    fixes.append("a larger memory_budget (larger stages save fewer layer inputs)")
    fixes.append("free host memory that other processes hold")
    raise HostMemoryError(
        f"the plan saves {count} layer inputs{' and residuals' if any(memory.residual_bytes) else ''} on the host per round ({microbatches} microbatches, "
        f"recompute_grain={grain!r}), {format_bytes(nbytes)}"
        f"{' as pinned downloads' if pinned else ''}, but the host has {format_bytes(available)} "
        f"available (MemAvailable in {MEMINFO}); the first forward would run out of host memory. "
        "To fit: " + "; or ".join(fixes)
    )
