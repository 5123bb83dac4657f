"""Weight prediction for the asynchronous optimizer: what a deferred P-copy writes.

Why: with staleness 1 the gradient of iteration t is taken at the weights after step t-2 but
applied to those after step t-1. A deferred P-copy can hand the devices a guess of the newer
weights instead: the version it copies extrapolated by the updates that produced it,
``W_v + k_1 (W_v - W_{v-1}) + k_2 (W_{v-1} - W_{v-2}) + ...`` (one factor: SpecTrain / XPipe's
weight prediction). For Adam-like optimizers consecutive updates point the same way, so the guess
lands near the weights the gradient will be applied to. Two factors, ``(2, -1)``, extrapolate the
last update and its change; with Adam's momentum that widens the range of curvatures a one-step-
late gradient stays stable in (docs/design.md, "Staleness remedies, measured"). It costs host
work only (a copy of the optimizer copy before each step and one pass over the remembered
weights in the P-copy instead of a copy) and one more fp32 tensor per trainable parameter and
factor; devices read one compute copy as before.

The previous weights are taken from the optimizer copy itself just before the step, so any
optimizer works (nothing reads its state), and a skipped step (fp16 overflow) predicts no
movement (with several factors it also forgets the updates before it). A factor whose update
has not been remembered yet (the first steps after the switch) is left out. This module must
never decide when a step or a P-copy runs: the scheduler's rules do.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightPredictor:
    """The optimizer-copy weights before the last steps, per trainable parameter, and the
    extrapolation factors (newest update first)."""

    def __init__(self, factors: float | tuple[float, ...]) -> None:
        self.factors = (float(factors),) if isinstance(factors, int | float) else tuple(map(float, factors))
        if not self.factors:
            raise ValueError("WeightPredictor needs at least one factor")
        # id(parameter) -> fp32 weights before the last steps, newest first, at most one per factor
        self.previous: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def remember(self, key: int, master: torch.Tensor, *, skipped: bool = False) -> None:
        """Called just before ``master`` is stepped: keep the weights the step starts from.
        ``skipped``: the step will not change them (fp16 overflow); the updates before it are
        forgotten too, so that the next prediction is no movement, not an extrapolation of them."""
        kept = self.previous.setdefault(key, [])
        if len(kept) < len(self.factors):
            kept.insert(0, master.detach().clone())
        else:
            oldest = kept.pop()  # its buffer takes the newest weights: no allocation per step
            oldest.copy_(master)
            kept.insert(0, oldest)
        if skipped:
            del kept[1:]

    @torch.no_grad()
    def predict_into(self, key: int, compute: torch.Tensor, master: torch.Tensor) -> None:
        """Write ``master + sum_j factor_j * (W_{j-1} - W_j)`` into the compute copy (in its
        dtype), ``W_{-1}`` being ``master`` and ``W_j`` the weights before the j-th last step.

        Without a remembered step (none taken since the predictor was made) the update is taken
        as zero and the master is copied as it is."""
        kept = self.previous.get(key, [])
        if not kept:
            compute.copy_(master)
            return
        factors = self.factors[: len(kept)]
        if compute.dtype == kept[0].dtype:
            extrapolate(compute, master, kept, factors)
            return
        # A kernel writing bf16/fp16 from fp32 inputs is about 4x slower on CPU than an fp32 one
        # plus a converting copy, so the sum is formed in fp32. The oldest remembered weights are
        # not read again once the next step remembers new ones in their buffer (step(s) ->
        # P-copy(s) -> step(s+1), rule 5): when every factor has its update, the sum is formed in
        # that buffer. Before that (the first steps after the switch) it takes a buffer of its own.
        if len(kept) < len(self.factors):
            scratch = torch.empty_like(kept[0])
            extrapolate(scratch, master, kept, factors)
        elif len(kept) == 1:
            scratch = kept[0]
            scratch.lerp_(master, 1.0 + factors[0])
        else:
            # By coefficients, the oldest buffer first so that it is read before it is written:
            # (1 + k_1) master + sum_i (k_{i+1} - k_i) W_i - k_n W_{n-1}, factors 1-based.
            scratch = kept[-1]
            scratch.mul_(-factors[-1])
            for i in range(len(kept) - 1):
                scratch.add_(kept[i], alpha=factors[i + 1] - factors[i])
            scratch.add_(master, alpha=1.0 + factors[0])
        compute.copy_(scratch)

    def state_dict(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """The newest remembered weights by parameter name (a resumed run predicts the same)."""
        return {names[key]: kept[0].clone() for key, kept in self.previous.items() if key in names and kept}

    def earlier_state_dict(self, names: dict[int, str]) -> list[dict[str, torch.Tensor]]:
        """The weights before the steps before the last, one dict per further factor."""
        return [
            {
                names[key]: kept[j].clone()
                for key, kept in self.previous.items()
                if key in names and len(kept) > j
            }
            for j in range(1, len(self.factors))
        ]

    def load_state_dict(
        self,
        state: dict[str, Any],
        keys: dict[str, int],
        earlier: list[dict[str, Any]] | None = None,
    ) -> None:
        """Restore saved weights; a parameter the state lacks (saved without prediction, before
        the first remembered step, or read fresh) remembers nothing, as in the run that saved
        it: its next prediction assumes no movement. Earlier weights the state lacks (saved with
        fewer factors, or before the steps that make them) stay missing: their factors are left
        out until the steps remember them. (Remembering the current weights instead would
        predict the same but through one more term, a rounding apart: a resume would not be
        bit-exact.)"""
        self.previous = {}
        for name, key in keys.items():
            saved = state.get(name)
            if saved is None:
                continue
            kept = [saved.detach().to(torch.float32).clone()]
            for older in (earlier or [])[: len(self.factors) - 1]:
                if older.get(name) is None:
                    break
                kept.append(older[name].detach().to(torch.float32).clone())
            self.previous[key] = kept


def extrapolate(
    out: torch.Tensor, master: torch.Tensor, kept: list[torch.Tensor], factors: tuple[float, ...]
) -> None:
    """``out = master + k_1 (master - W_0) + sum_{j>=1} k_{j+1} (W_{j-1} - W_j)``; ``out`` may
    not alias any input."""
    # lerp(W_0, master, 1 + k_1) = W_0 + (1 + k_1) * (master - W_0): the first factor in one pass.
    torch.lerp(kept[0], master, 1.0 + factors[0], out=out)
    for j in range(1, len(factors)):
        out.add_(kept[j - 1], alpha=factors[j]).add_(kept[j], alpha=-factors[j])
