"""Which slots of a plan hold a layer in common: what an async iteration's weights wait for.

Why a module of its own: the async ranking asks it of every candidate it models (the stream
model keys its task graphs by it), so it has a compiled form and a walk of its own, apart from the
model that reads it. Pure: stages in, slot lists out; it must never model a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from roundpipe.plan import native


def weight_waits(
    fwd: Sequence[range], fused: range, bwd: Sequence[range], shares: list[list[int]] | None = None
) -> list[list[int]]:
    """For each slot (dispatch order ``fwd, fused, bwd``), the fused and backward slots that hold
    one of its layers: an async iteration's upload of a layer waits for the step of two iterations
    back, which waits for that layer's gradients. ``shares``: `sharers` of the same stages, if at
    hand (these are its slots from the fused one on)."""
    if shares is None:
        shares = sharers(fwd, fused, bwd)
    return [[slot for slot in row if slot >= len(fwd)] for row in shares]


def sharers(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> list[list[int]]:
    """For each slot (dispatch order ``fwd, fused, bwd``), the slots that hold one of its layers,
    itself included: the runs whose uploads of those layers an async iteration's P-copy waits for.

    The ranking asks this of every candidate it models. The forward chain and the backward one
    (read shallowest first) each run over adjacent layer ranges from layer 0, the fused stage
    holds the rest: then one walk along both chains at once finds every overlapping pair (no
    more than the two chains' stages), where comparing every pair cost 5% of an async choice at
    94 layers. Stages of any other form are compared pair by pair."""
    f_count, b_count = len(fwd), len(bwd)
    if not _chains_meet(fwd, fused, bwd):
        stages = (*fwd, fused, *bwd)
        return [
            [j for j, held in enumerate(stages) if held.start < r.stop and r.start < held.stop]
            for r in stages
        ]
    rows: list[list[int]] = [[] for _ in range(f_count + 1 + b_count)]
    rows[f_count].append(f_count)
    i = k = 0  # fwd[i] and the backward stage k from the shallowest, slot f_count + b_count - k
    while i < f_count and k < b_count:
        b_slot = f_count + b_count - k
        rows[i].append(b_slot)
        rows[b_slot].append(i)
        f_stop, b_stop = fwd[i].stop, bwd[b_count - 1 - k].stop
        i += f_stop <= b_stop
        k += b_stop <= f_stop
    for i in range(f_count):
        rows[i].insert(0, i)  # the forward slot itself, first; then its backward slots, deepest last
        rows[i][1:] = rows[i][:0:-1]
    for b_slot in range(f_count + 1, f_count + 1 + b_count):
        rows[b_slot].append(b_slot)
    return rows


Rows = tuple[tuple[int, ...], ...]


def sharers_and_waits(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> tuple[Rows, Rows]:
    """`sharers` and `weight_waits` of the same stages, as tuples (what `stream_ms` keys its task
    graphs by). The async ranking asks them of every candidate it models (a quarter of its time at
    94 layers in Python): compiled where `native` was built, which compares every pair of stages
    (the walk above finds the same pairs, in the same order)."""
    kernels = native.kernels()
    if kernels is not None:
        return kernels.sharers((*fwd, fused, *bwd), len(fwd))  # type: ignore[no-any-return]
    shares = sharers(fwd, fused, bwd)
    waits = weight_waits(fwd, fused, bwd, shares)
    return tuple(map(tuple, shares)), tuple(map(tuple, waits))


def _chains_meet(fwd: Sequence[range], fused: range, bwd: Sequence[range]) -> bool:
    """Whether the forward chain and the backward one (deepest first) each cover [0, fused.start)
    with adjacent non-empty ranges, and the fused stage is non-empty: `sharers`' walk."""
    if not fwd or not bwd or not len(fused):
        return False
    if fwd[0].start != 0 or bwd[-1].start != 0 or fwd[-1].stop != fused.start or bwd[0].stop != fused.start:
        return False
    if not all(len(r) for r in fwd) or not all(len(r) for r in bwd):
        return False
    return all(r.stop == nxt.start for r, nxt in itertools.pairwise(fwd)) and all(
        nxt.stop == r.start for r, nxt in itertools.pairwise(bwd)
    )
