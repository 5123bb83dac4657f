"""The measured facts per layer that every memory figure of a plan starts from: `LayerMemory`.

Why a module of its own: the table is what profiling produces and what a run records, validated
once where it is made; the models over it (`roundpipe.plan.memory`: a stage's peak, a plan's, the
partitioner's bound) change with what is learnt about the engine, the facts do not. Pure data
over integers: it must never model a stage, import torch, measure, or touch a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from roundpipe.errors import PlanError


def _column(name: str, values: Sequence[int], count: int | None) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise PlanError(f"LayerMemory.{name} must be a list of byte counts, one per layer, got {values!r}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"LayerMemory.{name}[{i}] is {v!r}; give a whole number of bytes >= 0")
        out.append(v)
    if count is not None and len(out) != count:
        raise PlanError(f"LayerMemory.{name} has {len(out)} entries for {count} layers; give one per layer")
    return tuple(out)


@dataclass(frozen=True)
class LayerMemory:
    """Device bytes per layer, activations for ONE microbatch.

    - ``param_bytes``: the layer's parameters in the compute precision;
    - ``grad_bytes``: gradients of its trainable parameters on the device (compute precision);
    - ``saved_bytes``: what autograd saves for backward in the layer's forward with grad;
    - ``work_bytes``: peak transient of its forward, above input and output (or what it saves);
    - ``boundary_bytes``: the layer's input activation (all its tensors);
    - ``bwd_work_bytes``: peak transient of its backward above its saved activations, the output
      gradient and its parameter gradients (zeros when unknown);
    - ``carried_bytes``: the part of ``boundary_bytes`` that is constants carried unchanged from
      layer to layer (``"_"`` keys: rotary tables, masks, labels), one storage however many
      activations refer to it (zeros when unknown);
    - ``saved_grad_bytes``: the part of ``saved_bytes`` that is the layer's own parameter
      gradients, computed ahead in the forward (a chunked loss does), which the backward hands on
      instead of allocating them (zeros when unknown);
    - ``dense_bytes``: dense copies of the layer's 4-bit frozen weights that a stage run holds
      from its first compute to its last, when it dequantizes once per run (zeros when the layer
      dequantizes inside each call, or holds no 4-bit weight);
    - ``residual_bytes``: the post-attention residual a forward stage saves beside the layer's
      input under ``recompute_grain="layer_input"`` (`roundpipe.model.attention_residual`); zeros
      where the layer keeps none or the run saves none (`without_residuals`).
    """

    param_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    work_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]
    bwd_work_bytes: tuple[int, ...] = ()
    carried_bytes: tuple[int, ...] = ()
    names: tuple[str, ...] | None = None
    saved_grad_bytes: tuple[int, ...] = ()
    dense_bytes: tuple[int, ...] = ()
    residual_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        params = _column("param_bytes", self.param_bytes, None)
        n = len(params)
        if n == 0:
            raise PlanError("LayerMemory is empty; a model needs at least 1 layer")
        object.__setattr__(self, "param_bytes", params)
        for name in ("grad_bytes", "saved_bytes", "work_bytes", "boundary_bytes"):
            object.__setattr__(self, name, _column(name, getattr(self, name), n))
        for name in ("bwd_work_bytes", "carried_bytes", "saved_grad_bytes", "dense_bytes", "residual_bytes"):
            values = getattr(self, name) or (0,) * n
            object.__setattr__(self, name, _column(name, values, n))
        for part, whole in (("carried_bytes", "boundary_bytes"), ("saved_grad_bytes", "saved_bytes")):
            for i, (a, b) in enumerate(zip(getattr(self, part), getattr(self, whole), strict=True)):
                if a > b:
                    raise PlanError(f"{self.label(i)}: {part} {a} > {whole} {b}, of which they are part")
        if self.names is not None:
            object.__setattr__(self, "names", tuple(str(x) for x in self.names))
            if len(self.names) != n:
                raise PlanError(f"LayerMemory.names has {len(self.names)} entries for {n} layers")

    @property
    def num_layers(self) -> int:
        return len(self.param_bytes)

    def label(self, index: int) -> str:
        if self.names is not None and 0 <= index < len(self.names):
            return f"layer {index} ({self.names[index]!r})"
        return f"layer {index}"

    def without_residuals(self) -> LayerMemory:
        """The same layers in a run that saves no residual."""
        return replace(self, residual_bytes=(0,) * self.num_layers) if any(self.residual_bytes) else self

    def output_bytes(self, layer: int) -> int:
        """The layer's output: the next layer's input (the last layer returns a scalar loss)."""
        return self.boundary_bytes[layer + 1] if layer + 1 < self.num_layers else 0

    def scaled(self, factor: float) -> LayerMemory:
        """The same layers at ``factor`` x the tokens per microbatch: activation bytes scale,
        parameters and gradients do not (attention through sdpa/flash is linear in tokens)."""

        def s(column: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(math.ceil(x * factor) for x in column)

        boundary = s(self.boundary_bytes)
        carried = tuple(min(c, b) for c, b in zip(s(self.carried_bytes), boundary, strict=True))
        grads_ahead = self.saved_grad_bytes  # parameter-sized: they do not scale
        own = tuple(saved - g for saved, g in zip(self.saved_bytes, grads_ahead, strict=True))
        saved = tuple(x + g for x, g in zip(s(own), grads_ahead, strict=True))
        activations = (saved, s(self.work_bytes), boundary, s(self.bwd_work_bytes), carried)
        return LayerMemory(
            self.param_bytes,
            self.grad_bytes,
            *activations,
            names=self.names,
            saved_grad_bytes=grads_ahead,
            dense_bytes=self.dense_bytes,
            residual_bytes=s(self.residual_bytes),
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: v if v is None else list(v) for f in fields(self) for v in [getattr(self, f.name)]}
