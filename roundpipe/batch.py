"""Splitting a batch into microbatches, and the weights that keep the loss a full-batch mean.

Inputs and targets may be a tensor or a dict / tuple / list of tensors; all of them are split on
dim 0 into the same contiguous pieces, like ``torch.chunk`` but always into exactly the requested
number (an error says why when that is impossible). When the pieces are uneven, each
microbatch's loss is weighted by its share of the samples, so the gradient is that of the mean
over the whole batch and does not depend on how it was split.

Nothing here copies data: microbatches are views of the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from roundpipe.errors import InputError

Batch = Any  # a tensor, or a (nested) dict / tuple / list of tensors; other leaves are passed as they are


def batch_size(batch: Batch, what: str = "inputs") -> int:
    """The common dim-0 size of every tensor in ``batch``."""
    sizes: dict[str, int] = {}
    _collect_sizes(batch, "", what, sizes)
    if not sizes:
        raise InputError(f"{what} holds no tensor; pass a tensor or a dict/tuple of tensors")
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{what}{k} has {v}" for k, v in sizes.items())
        raise InputError(f"{what} tensors disagree on the batch size (dim 0): {listing}")
    return distinct.pop()


def _collect_sizes(obj: Any, path: str, what: str, sizes: dict[str, int]) -> None:
    # Module functions, not closures that call themselves: those are reference cycles that only
    # the garbage collector frees (every call, for the life of a training run).
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            raise InputError(f"{what}{path} is a 0-d tensor; it cannot be split into microbatches on dim 0")
        sizes[path or "<tensor>"] = obj.shape[0]
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _collect_sizes(value, f"{path}[{key!r}]", what, sizes)
    elif isinstance(obj, tuple | list):
        for i, value in enumerate(obj):
            _collect_sizes(value, f"{path}[{i}]", what, sizes)


def split_sizes(total: int, num_microbatches: int, what: str = "inputs") -> list[int]:
    """Sizes of ``num_microbatches`` contiguous pieces of ``total`` samples, as even as possible."""
    if num_microbatches > total:
        raise InputError(
            f"{what} has {total} sample(s) but num_microbatches={num_microbatches}; "
            f"use a batch of at least {num_microbatches} samples or set num_microbatches <= {total}"
        )
    base, extra = divmod(total, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def split_batch(batch: Batch, sizes: list[int]) -> list[Batch]:
    """Split every tensor of ``batch`` on dim 0 into pieces of ``sizes``."""
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, sizes, dim=0))
    if isinstance(batch, Mapping):
        parts = {key: split_batch(value, sizes) for key, value in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]
    if isinstance(batch, tuple | list):
        columns = [split_batch(value, sizes) for value in batch]
        return [type(batch)(col[i] for col in columns) for i in range(len(sizes))]
    return [batch] * len(sizes)


def microbatches(
    inputs: Batch, targets: Batch | None, num_microbatches: int
) -> tuple[list[Batch], list[Batch | None], list[float]]:
    """Split inputs and targets alike; return both lists and the per-microbatch loss weights."""
    total = batch_size(inputs, "inputs")
    if targets is not None:
        target_total = batch_size(targets, "targets")
        if target_total != total:
            raise InputError(
                f"inputs have batch size {total} but targets have {target_total}; they must match"
            )
    sizes = split_sizes(total, num_microbatches)
    input_parts = split_batch(inputs, sizes)
    target_parts: list[Batch | None] = (
        split_batch(targets, sizes) if targets is not None else [None] * len(sizes)
    )
    weights = [size / total for size in sizes]
    return input_parts, target_parts, weights
