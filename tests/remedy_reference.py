"""The plain-PyTorch reference of the asynchronous optimizer with its staleness remedies.

Deliberately naive, like `tests.helpers.async_reference`, which it generalises: the weights
after every step are kept, and the weights iteration t computes on are built from them by the
definition in docs/design.md ("Staleness remedies"), never by roundpipe's code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from tests.helpers import LossFn


def remedy_reference(
    model: nn.Module,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    *,
    warmup_steps: int = 0,
    prediction: float | tuple[float, ...] = 0.0,
    lr_ramp: tuple[int, float] = (0, 1.0),
    fresh: tuple[str, ...] = (),
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Iterations t < ``warmup_steps`` compute on W_t (sync). Later ones on W_{t-1}, and, when
    the step that made W_{t-1} was taken asynchronously (t-2 >= warmup_steps - 1), on
    W_{t-1} + prediction * (W_{t-1} - W_{t-2}); with factors (k_1, k_2, ...) on
    W_{t-1} + sum_j k_j (W_{t-j} - W_{t-j-1}), each term only when the step that made W_{t-j}
    was asynchronous (t-1-j >= warmup_steps - 1). Gradients are applied to the newest weights;
    with ``lr_ramp = (R, r)`` step t >= warmup_steps runs at the lr times
    r + (1 - r) * min(1, (t - warmup_steps + 1) / R). The parameters whose names start with one
    of ``fresh`` always read W_t (staleness 0, never predicted). Returns the losses and the
    weights after every step."""
    opt = optimizer(list(model.parameters()))
    history = [copy.deepcopy(model.state_dict())]  # history[k] = weights after k steps
    shadow = copy.deepcopy(model)
    losses, weights = [], []
    for t, (x, y) in enumerate(data):
        if t < warmup_steps:
            read = history[t]
        elif t < 2 or t - 2 < warmup_steps - 1 or not prediction:
            read = history[max(0, t - 1)]
        else:
            factors = (prediction,) if isinstance(prediction, float) else prediction
            read = {k: v.clone() for k, v in history[t - 1].items()}
            for j, factor in enumerate(factors, start=1):
                if t - 1 - j < max(0, warmup_steps - 1):
                    break
                newer, older = history[t - j], history[t - j - 1]
                for k in read:
                    read[k] += factor * (newer[k] - older[k])
        read = {k: history[t][k] if k.startswith(fresh) else v for k, v in read.items()}
        shadow.load_state_dict(read)
        shadow.zero_grad()
        loss = loss_fn(shadow(x), y)
        loss.backward()
        for p, s in zip(model.parameters(), shadow.parameters(), strict=True):
            p.grad = s.grad.clone()
        ramp_steps, start = lr_ramp
        factor = (
            1.0
            if not ramp_steps or t < warmup_steps
            else start + (1 - start) * min(1.0, (t - warmup_steps + 1) / ramp_steps)
        )
        lrs = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor
        opt.step()
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        opt.zero_grad()
        history.append(copy.deepcopy(model.state_dict()))
        losses.append(loss.item())
        weights.append(copy.deepcopy(model.state_dict()))
    return losses, weights
