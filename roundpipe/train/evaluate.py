"""Evaluation during `roundpipe train`: the eval set's loss and perplexity at the current weights.

Why apart from the loop: what "the eval loss" means is decided here once. It is the mean over
every token that has a label, so it does not depend on how the examples were laid into rows
(padded or packed) or batched: each call evaluates one training microbatch's worth of rows as a
single piece (`RoundPipe.evaluate` with ``microbatches=1``), and the calls are weighted by their
tokens. Evaluation goes through the pipe's forward-only path, so it touches no gradient and no
optimizer state, and training after it computes what it would have computed without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from roundpipe.data.examples import IGNORE_INDEX
from roundpipe.pipe import RoundPipe


def label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that count in the loss: labels shifted by one (the first has no prediction)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def evaluate(
    pipe: RoundPipe,
    batches: list[dict[str, torch.Tensor]],
    step: int,
    add_up: Callable[[list[float]], list[float]] | None = None,
) -> dict[str, Any]:
    """The metrics record of an evaluation at ``step``: eval_loss, eval_perplexity, eval_tokens.
    ``add_up`` sums (loss x tokens, tokens) over the processes that each evaluated a share."""
    total, tokens = 0.0, 0
    for batch in batches:
        count = label_tokens(batch)
        if count:
            total += pipe.evaluate(batch, microbatches=1) * count
            tokens += count
    if add_up is not None:
        total, summed = add_up([total, float(tokens)])
        tokens = int(summed)
    loss = total / tokens if tokens else float("nan")
    perplexity = math.exp(loss) if loss < 700 else float("inf")
    return {"step": step, "eval_loss": loss, "eval_perplexity": perplexity, "eval_tokens": tokens}


__all__ = ["evaluate", "label_tokens"]
