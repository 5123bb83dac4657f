"""Which recompute grain a run with ``RunConfig.recompute_grain="auto"`` takes.

Why a choice of the planner: a backward stage recomputes its layers' forward before its backward.
From the stage's input ("stage") only its last layer's recompute can leave out the frozen product
that ends a decoder layer (`roundpipe.model.frozen_tail`); from every layer's own input, which the
forward stage saved to the host ("layer_input"), every layer's recompute leaves it out: on a
Llama-style LoRA or QLoRA model that is a quarter of the recompute's matrix work, paid for with one
more download and upload of each layer's input a microbatch, and those inputs held on the host
for the round. On one H100 under 24 GiB that bought 5% on a Qwen3-32B shape (3,001 tok/s against
2,858, `bash bench/gpu_big.sh E-inputs`) and 3.4% on a Qwen3-14B shape (6,752 against 6,533:
`bash bench/gpu_big.sh C-inputs`, C in `bench/gpu_regress.sh`), computing 99.98-99.99% of the
step either way.

The rule, in order:

- only on CUDA: a CPU worker's device memory is the host's, and it has no link to overlap the
  extra transfers with (there "auto" is "stage");
- only where every decoder layer ends in a frozen dense ``down_proj`` (`frozen_tail.dense_tail_width`):
  a layer whose ``down_proj`` trains has no product to leave out, and a mixture of experts' tail
  is small beside its routing, where the extra transfers cost more than they save (Qwen3-30B-A3B
  at 16 x 4096, two H100 machines: 12,348 tok/s with "layer_input" against 12,979 with "stage");
- only for a hidden size of at least `MIN_WIDTH`: a layer input crosses the link twice, 4 bytes a
  token per unit of width, while the compute it rides on grows with the width squared. E (5,120)
  spent 5% more of its step on the link for it; the same arithmetic puts a 2,048-wide model near a
  quarter of an H100's step and a 1,024-wide one near half, on top of its weights' uploads, where
  the link may become the bound and no gain has been measured;
- only where a plan at that grain fits the memory budget;
- only where the layer inputs one round saves on the host (`host_activations`) take at most
  `HOST_SHARE` of what the host has available when the plan is made (the model's weights are
  already there), divided among the processes torchrun starts on the host (``LOCAL_WORLD_SIZE``:
  each sees the same available memory): a long sequence saves a layer input of gigabytes per layer
  (262,144 tokens of an 8B shape: 2 GiB each), and the rest of the host serves the run's other
  growth. With ``RunConfig.save_residuals`` each layer's post-attention residual is saved beside
  its input (`roundpipe.model.attention_residual`: the recompute then leaves out ``o_proj`` too)
  where the inputs and residuals fit so; else the inputs alone, where they fit.

What holds: the choice reads shapes and the plans' predictions, never a tensor's value, and
changes what is computed only as ``recompute_grain`` itself does (the same gradients up to the
order of float sums, `tests/test_frozen_tail.py`); "stage" where any condition fails or is unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from torch import nn

from roundpipe.config import RunConfig, local_processes
from roundpipe.errors import PlanError
from roundpipe.model.frozen_tail import dense_tail_width
from roundpipe.plan.memory import Grain
from roundpipe.plan.sizes import format_bytes

Planned = TypeVar("Planned")

HOST_SHARE = 0.5
"""The most of the host's available bytes that "auto" lets one round's saved layer inputs take."""

MIN_WIDTH = 4096
"""The narrowest hidden size for which "auto" may choose "layer_input" (the rule's third point)."""

CHOOSES_ON = frozenset({"cuda"})
"""The device kinds on which "auto" may choose "layer_input" (elsewhere it is "stage")."""


def initial_grain(config: RunConfig) -> Grain:
    """The grain a run uses until a plan made on its device chooses ("auto": "stage")."""
    return "stage" if config.recompute_grain == "auto" else config.recompute_grain


def host_room(available: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """What one process may let its saved layer inputs take of ``available`` host bytes."""
    processes = max(1, local_processes(environ))
    return None if available is None else int(HOST_SHARE * available) // processes


def auto_may_take_layer_input(layers: Sequence[nn.Module], kind: str) -> bool:
    """Whether "auto" may take layer_input on ``kind`` devices for ``layers`` before any plan is
    made: the rule's first three points."""
    return why_not_layer_input(layers, kind) is None


def why_not_layer_input(layers: Sequence[nn.Module], kind: str) -> str | None:
    """Why "auto" keeps "stage" on ``kind`` devices for ``layers`` whatever the plans: the first of
    the rule's first three points that fails, or None where all hold."""
    if kind not in CHOOSES_ON:
        return f"auto: {kind} devices recompute each backward stage from its input"
    width = dense_tail_width(layers)  # walks every module: only where the device allows the choice
    if width == 0:
        return "auto: not every decoder layer ends in a frozen dense down_proj"
    if width < MIN_WIDTH:
        return f"auto: {width} wide, under {MIN_WIDTH}"
    return None


def choose_grain(
    config: RunConfig,
    layers: Sequence[nn.Module],
    kind: str,
    plan_at: Callable[[Grain, bool], Planned],
    saved_bytes: Callable[[Planned], int],
    room: int | None,
) -> tuple[Planned, str]:
    """The plan ``plan_at(grain, residuals)`` makes at the grain ``config.recompute_grain`` names,
    or for "auto" at the one the rule in the module docstring picks, and why that grain.
    ``residuals``: saved where the run may (``config.save_residuals``); ``saved_bytes(plan)``
    counts what one round of ``plan`` saves on the host; ``room`` is what it may take
    (`host_room`; None: unknown)."""
    residuals = config.save_residuals
    if config.recompute_grain != "auto":
        return plan_at(config.recompute_grain, residuals), "named in RunConfig.recompute_grain"
    why_not = why_not_layer_input(layers, kind)
    if why_not is not None:
        return plan_at("stage", False), why_not
    if room is None:
        return plan_at("stage", False), "auto: the host's available memory is unknown"
    why = "auto: no plan fits the memory budget at layer_input"
    for with_residuals in dict.fromkeys((residuals, False)):  # with them first, where the run may
        try:
            planned = plan_at("layer_input", with_residuals)
        except PlanError:
            continue
        kept_residuals = saves_residuals(planned)
        what = "layer inputs and residuals" if kept_residuals else "layer inputs"
        saved = saved_bytes(planned)
        if saved <= room:
            return (
                planned,
                f"auto: one round's {what} ({format_bytes(saved)}) fit the host room ({format_bytes(room)})",
            )
        why = f"auto: one round's {what} ({format_bytes(saved)}) exceed the host room ({format_bytes(room)})"
        if not kept_residuals:
            break  # without them the same plan
    return plan_at("stage", False), why


def saves_residuals(planned: object) -> bool:
    """Whether ``planned`` (a `DevicePlan`, or whatever a test plans) saves residuals."""
    return bool(getattr(planned, "residuals", False))
