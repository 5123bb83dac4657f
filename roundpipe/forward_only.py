"""Forward only: the loss of a batch at the pipe's current weights, for evaluation.

Why not a task graph: evaluation needs neither gradients, nor activations kept for a backward,
nor the optimizer, so none of what the schedule exists to overlap. It runs the pipe's own layer
sequence (the same layers, hence the same masks, loss and LoRA adapters as training) one layer at
a time on the pipe's first device, after `RoundPipe.synchronize` has written the newest weights
into the module. On a GPU each layer's weights are uploaded while it runs and dropped after, like
a transient copy; on the CPU the layers run in place. Layers are put in eval mode for the call
(dropout off) and put back as they were.

It must never touch gradients, the optimizer copy or its state, the schedule or its counters:
training after an evaluation computes exactly what it would have computed without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from roundpipe.backends.tensors import to_device
from roundpipe.batch import microbatches
from roundpipe.model.sequence import LayerSequence


@contextmanager
def _eval_mode(layers: list[nn.Module]) -> Iterator[None]:
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    for layer in layers:
        layer.train(False)
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _on_device(layer: nn.Module, device: torch.device) -> Callable[[Any], Any]:
    """``layer`` called with its weights on ``device`` (no copy when they are there already)."""
    tensors = {name: t.to(device) for name, t in chain(layer.named_parameters(), layer.named_buffers())}
    return lambda x: functional_call(layer, tensors, (x,))


def forward_only(
    sequence: LayerSequence,
    device: torch.device,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., Any] | None,
    num_microbatches: int,
) -> float:
    """The mean microbatch loss of ``inputs``, split and weighted as `forward_backward` does."""
    parts, target_parts, weights = microbatches(inputs, targets, num_microbatches)
    xs = [to_device(part, device) for part in parts]
    with torch.no_grad(), _eval_mode(sequence.layers):
        for layer in sequence.layers:
            run = _on_device(layer, device)
            xs = [run(x) for x in xs]
        if not sequence.computes_loss:
            if loss_fn is None:
                raise ValueError("loss_fn is required: the model's last layer does not compute a loss")
            xs = [loss_fn(x, to_device(t, device)) for x, t in zip(xs, target_parts, strict=True)]
    return float(sum(w * float(loss) for w, loss in zip(weights, xs, strict=True)))


__all__ = ["forward_only"]
