"""A decoder layer's MLP over a long sequence, a slice of tokens at a time.

Why: the MLP is per token, and on a long sequence its intermediates dominate a layer's memory. At
131,072 tokens a Qwen3-1.7B MLP (intermediate 6144) makes four or five 131K x 6144 tensors of 1.6 GB
each, and autograd keeps most of them for the backward; recompute at layer grain cannot go below
one layer. Run in slices of `CHUNK_TOKENS`, each slice under activation checkpointing, the MLP keeps
only its input and output for the backward, and its backward holds one slice's intermediates at a
time; the price is the MLP's forward once more in the backward, paid only above
`MIN_TOKENS` tokens per call (short sequences run the original forward, unchanged).

How much a run slices is its `LongRowSlicing` switch, which `attach_slicing` hands to every sliced
module of a copy (the same object to all copies of a run, so one assignment reaches them all):
nothing, the per-token modules (this module's), or those and whole decoder layers
(`roundpipe.model.chunked_layer`). Slicing trades memory for time (the sliced parts are computed
again in the backward, and run eagerly: a compiled layer breaks its graph there), so a run with a
memory budget plans with the least slicing that fits (`roundpipe.pipe_machinery`). A module
without a switch slices.

How: `chunk_long_sequences(mlp)` swaps the module's class for a subclass whose ``forward`` slices
(same parameters, same names, same state dict), so it is applied to roundpipe's own copies of a
layer (replicas, profile copies), never to the user's model. Each slice's result is that of the
original forward on those rows: the numbers are the same up to the matrix products' blocking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.model.frozen_tail import reading_outputs
from roundpipe.model.swap_class import subclass_of

CHUNK_TOKENS = 16384
MIN_TOKENS = 2 * CHUNK_TOKENS
_subclasses: dict[type, type] = {}
_SWITCH = "_roundpipe_slicing"


SLICING_LEVELS = ("whole", "modules", "layers")
"""What a run's copies slice over long rows, least first: nothing; the per-token modules
(`chunk_long_sequences`: an MLP, the head's final norm); those and whole decoder layers."""


@dataclass
class LongRowSlicing:
    """How much the sliced modules of a run's copies slice rows of `MIN_TOKENS` tokens or more."""

    level: str = "layers"

    def slices(self, kind: str) -> bool:
        """Whether sliced modules of ``kind`` (``"modules"`` or ``"layers"``) slice at this level."""
        return SLICING_LEVELS.index(self.level) >= SLICING_LEVELS.index(kind)


def attach_slicing(module: nn.Module, switch: LongRowSlicing) -> int:
    """Give every sliced module inside ``module`` (`chunk_long_sequences`, and the whole layers of
    `roundpipe.model.chunked_layer`) ``switch``; how many got it."""
    sliced = [m for m in module.modules() if getattr(type(m), "_roundpipe_sliced", None)]
    for sub in sliced:
        object.__setattr__(sub, _SWITCH, switch)
    return len(sliced)


def slicing_on(module: nn.Module) -> bool:
    """Whether ``module`` slices long rows: no switch, or its switch's level takes in its kind."""
    switch = getattr(module, _SWITCH, None)
    return switch is None or bool(switch.slices(getattr(type(module), "_roundpipe_sliced")))  # noqa: B009


def long_rows(sample: Any) -> bool:
    """Whether ``sample`` (a tensor, or a mapping or sequence of them) holds `MIN_TOKENS` tokens or
    more (rows times their length, the first two dimensions of a tensor of two or more): what the
    sliced MLP counts; a sliced layer asks for that many in one row, which implies it."""
    if isinstance(sample, torch.Tensor):
        return sample.dim() >= 2 and sample.shape[0] * sample.shape[1] >= MIN_TOKENS
    if isinstance(sample, Mapping):
        return any(long_rows(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return any(long_rows(v) for v in sample)
    return False


def chunk_long_sequences(mlp: nn.Module) -> nn.Module:
    """Make ``mlp`` (a per-token module, ``[..., hidden] -> [..., hidden]``) slice long inputs."""
    base = type(mlp)
    if getattr(base, "_roundpipe_sliced", None) == "modules":
        return mlp
    mlp.__class__ = subclass_of(_subclasses, base, "SequenceChunked", _methods)
    return mlp


def _slots(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """Every parameter slot of ``module`` (the dict that holds it and its name there)."""
    out: list[tuple[dict[str, Any], str]] = []
    for sub in module.modules():
        out.extend((sub._parameters, leaf) for leaf, p in sub._parameters.items() if p is not None)
    return out


def _methods(base: type) -> dict[str, Any]:
    original: Any = getattr(base, "forward")  # noqa: B009 (a module class; mypy sees a plain type)

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tokens = x.numel() // max(1, x.shape[-1])
        if args or kwargs or x.dim() < 2 or tokens < MIN_TOKENS or not slicing_on(self):
            return original(self, x, *args, **kwargs)
        return sliced(self, x, tokens)

    # Not traced by torch.compile (a compiled layer breaks its graph here, for long inputs only:
    # shapes are static, so a short input's graph never reaches this): the slot rebinding below
    # is Python state that a captured graph must not bake in.
    @torch.compiler.disable
    @reading_outputs  # its slices are recomputed in the backward, where no tail skips
    def sliced(self: nn.Module, x: torch.Tensor, tokens: int) -> Any:
        flat = x.reshape(tokens, x.shape[-1])
        slices = [flat[start : start + CHUNK_TOKENS] for start in range(0, tokens, CHUNK_TOKENS)]
        if not torch.is_grad_enabled():
            outs = [original(self, part) for part in slices]
        else:
            # The recompute runs in the backward, when roundpipe's replicas have put placeholders
            # back into their parameter slots: the tensors bound now are passed along and bound
            # again for it.
            slots = _slots(self)
            bound = [table[leaf] for table, leaf in slots]

            def run(part: torch.Tensor, *params: torch.Tensor) -> Any:
                current = [table[leaf] for table, leaf in slots]
                for (table, leaf), param in zip(slots, params, strict=True):
                    table[leaf] = param
                try:
                    return original(self, part)
                finally:
                    for (table, leaf), param in zip(slots, current, strict=True):
                        table[leaf] = param

            outs = [checkpoint(run, part, *bound, use_reentrant=False) for part in slices]
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    # Its kind of slicing (`LongRowSlicing`), which also marks it swapped already.
    return {"forward": forward, "_roundpipe_sliced": "modules", "__module__": base.__module__}
