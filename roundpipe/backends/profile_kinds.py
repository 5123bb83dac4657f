"""Which layers of a model cost the same, so that a profile may measure one of each kind.

Why: the profile runs every layer once on one microbatch (`roundpipe.backends.profile`). At long
sequences that is as long as a training step: 32 layers of an 8B model at 262,144 tokens take
minutes before the first step. Decoder layers of one model are copies of one another, and the
planner needs each one's times and bytes, not 32 draws of the same figures, so with
``RunConfig.profile="one_per_kind"`` the first layer of each kind is measured and the others take
its figures.

What makes a kind: the layer's class, its parameters' names, shapes and dtypes, its input's
structure (every tensor's shape and dtype, and how they nest), whether it is the last layer, and,
for every submodule, its class and the attributes transformers uses to vary attention between
layers of one class (``attention_type``, ``sliding_window``, ``is_sliding``): a model alternating
sliding-window and full attention has two kinds of decoder layer. A layer is skipped only when its
kind's measured layer returned what it was given in structure (a decoder layer maps hidden states
to hidden states), so the skipped layer's input is the one the profile already holds.

It must never run a layer or hold a tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.utils import _pytree

from roundpipe.backends.storages import collect_storages

_VARYING = ("attention_type", "sliding_window", "is_sliding")
M = TypeVar("M")  # a layer's measurement: a dataclass with ``index`` and ``name``


def structure(x: Any) -> tuple[Any, ...]:
    """How ``x`` nests and every tensor's shape and dtype (other leaves by type)."""
    leaves, spec = _pytree.tree_flatten(x)
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves)
    return (str(spec), shapes)


def _parameters(layer: nn.Module) -> tuple[Any, ...]:
    return tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())


def _modules(layer: nn.Module) -> tuple[Any, ...]:
    return tuple(
        (name, type(m).__name__, *(str(getattr(m, a, None)) for a in _VARYING))
        for name, m in layer.named_modules()
    )


def cost_kind(layer: nn.Module, x: Any, last: bool) -> tuple[Any, ...]:
    """The kind of ``layer`` on input ``x`` (module docstring)."""
    return (type(layer), _parameters(layer), _modules(layer), structure(x), last)


def warm_up_kind(layer: nn.Module, x: Any, last: bool) -> tuple[Any, ...]:
    """What one warm-up serves: the layer's class, its parameters' names, shapes and dtypes, its
    submodules' classes and attention variant (as in `cost_kind`), and its input's tensor shapes.
    Decoder layers of one model share it, so only the first is warmed up (at 262,144 tokens an 8B
    layer's warm-up is a full forward and backward, about 5 s). The attention variant counts
    because a compiled layer traces a graph per variant: without its own warm-up, GPT-OSS-20B's
    first full-attention layer was timed compiling (1,033 ms forward against 3.3 ms for its
    neighbours), and the re-plan, which scales the profile to the device's timing, took every
    other forward layer for 0.2 ms."""
    inputs: dict[int, int] = {}
    collect_storages(x, inputs)
    return (type(layer), _parameters(layer), _modules(layer), tuple(sorted(inputs.values())), last)


class OnePerKind(Generic[M]):
    """The measurement of each kind so far, for a profile that measures one layer of each
    (``enabled``; otherwise it never reuses). Call `reuse` before measuring a layer and, when it
    gives nothing, `measured` after."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._by_kind: dict[tuple[Any, ...], M] = {}
        self._pending: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def reuse(self, layer: nn.Module, x: Any, last: bool, index: int, name: str) -> M | None:
        """The figures of ``layer``'s kind, renamed for it, when one of its kind was measured."""
        self._pending = None
        if not self.enabled:
            return None
        kind = cost_kind(layer, x, last)
        found = self._by_kind.get(kind)
        if found is not None:
            # M is a dataclass, which a TypeVar cannot say.
            return replace(found, index=index, name=name)  # type: ignore[type-var]
        self._pending = (kind, structure(x))
        return None

    def measured(self, measurement: M, output: Any) -> None:
        """Keep ``measurement`` for its kind when the layer returned what it was given in
        structure (a later layer of the kind is then fed the input the profile holds)."""
        if self._pending is not None and structure(output) == self._pending[1]:
            self._by_kind[self._pending[0]] = measurement
        self._pending = None
