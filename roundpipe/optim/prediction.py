"""Weight prediction for the asynchronous optimizer: what a deferred P-copy writes.

Why: with staleness 1 the gradient of iteration t is taken at the weights after step t-2 but
applied to those after step t-1. A deferred P-copy can hand the devices a guess of the newer
weights instead: the version it copies extrapolated by the update that produced it,
``W_v + k * (W_v - W_{v-1})`` (SpecTrain / XPipe's weight prediction). For Adam-like optimizers
consecutive updates point the same way, so the guess lands near the weights the gradient will be
applied to. It costs host work only (a copy of the optimizer copy before each step and one lerp
in the P-copy instead of a copy) and one more fp32 tensor per trainable parameter; devices read
one compute copy as before.

The previous weights are taken from the optimizer copy itself just before the step, so any
optimizer works (nothing reads its state), and a skipped step (fp16 overflow) predicts no
movement. This module must never decide when a step or a P-copy runs: the scheduler's rules do.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightPredictor:
    """Previous optimizer-copy weights per trainable parameter and the extrapolation factor."""

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self.previous: dict[int, torch.Tensor] = {}  # id(parameter) -> fp32 weights before the step

    @torch.no_grad()
    def remember(self, key: int, master: torch.Tensor) -> None:
        """Called just before ``master`` is stepped: keep the weights the step starts from."""
        previous = self.previous.get(key)
        if previous is None:
            self.previous[key] = master.detach().clone()
        else:
            previous.copy_(master)

    @torch.no_grad()
    def predict_into(self, key: int, compute: torch.Tensor, master: torch.Tensor) -> None:
        """Write ``master + factor * (master - previous)`` into the compute copy (in its dtype).

        Without a remembered step (none taken since the predictor was made) the update is taken
        as zero and the master is copied as it is."""
        previous = self.previous.get(key)
        if previous is None:
            compute.copy_(master)
            return
        # lerp(previous, master, 1 + k) = previous + (1 + k) * (master - previous): one pass.
        weight = 1.0 + self.factor
        if compute.dtype == previous.dtype:
            torch.lerp(previous, master, weight, out=compute)
            return
        # A kernel writing bf16/fp16 from fp32 inputs is about 4x slower on CPU than an fp32 one
        # plus a converting copy. The previous weights are not read again before the next step
        # remembers new ones (step(s) -> P-copy(s) -> step(s+1), rule 5), so extrapolate in place.
        previous.lerp_(master, weight)
        compute.copy_(previous)

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """The remembered weights by parameter name (a resumed run predicts the same)."""
        return {names[key]: tensor.clone() for key, tensor in self.previous.items() if key in names}

    def load_state_dict(
        self, state: dict[str, Any], keys: dict[str, int], masters: dict[int, torch.Tensor]
    ) -> None:
        """Restore saved weights; a parameter the state lacks (saved without prediction) starts
        from its current weights, i.e. the next prediction assumes no movement."""
        self.previous = {}
        for name, key in keys.items():
            saved = state.get(name)
            source = saved if saved is not None else masters[key]
            self.previous[key] = source.detach().to(torch.float32).clone()
