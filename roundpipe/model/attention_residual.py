"""A decoder layer recomputed from its saved input and its saved post-attention residual leaves
out the frozen ``o_proj`` product.

Why: under ``recompute_grain="layer_input"`` every decoder layer is recomputed from its own saved
input, and `frozen_tail` already leaves out its last frozen product (``mlp.down_proj``). Its
``o_proj`` product is read once more: as part of the residual ``input + o_proj(attention)`` that
enters ``post_attention_layernorm`` and the MLP. Its backward needs only the weight (the gradient
of its input is ``grad @ W``); the attention's output, which LoRA on ``o_proj`` reads, is
recomputed anyway. So where the forward stage saves that residual beside the layer's input, the
recompute takes it from there and skips the product: on a Qwen3-32B layer 5,120 x 8,192 of its
487.5M frozen weights a token, about 2.8% of a layer's forward, recompute and backward, for one
more hidden-sized tensor a layer crossing the link each way.

How: `install` gives roundpipe's copy of a decoder layer (the classes `frozen_tail.TAIL_LAYERS`
lists, with a frozen linear ``self_attn.o_proj`` and a ``post_attention_layernorm``) a pre-hook
on ``post_attention_layernorm`` and ``o_proj``'s frozen linear the subclass that can return
`frozen_tail._UnreadProduct`. The norm's ``residual_mode`` says what the hook does: `KEEP` (a
forward without grad) appends the residual to the norm's ``residual_store``; `USE` (the recompute)
passes on the stored residual through `_Substitute`, whose value is the stored tensor and whose
gradient goes to the residual the recompute computed, so every weight and the layer's input get
the gradients of the full recompute; ``o_proj`` is flagged unread then, so what it adds is zeros.
`keeping` and `using` set both for one call. The mode, the store and the flag are attributes of
the copy from `install` on, so a compiled layer guards on their values and each mode is one
variant of the graph (a forward without grad keeps, a recompute uses: the variants grad mode and
the frozen tail already make).

What holds: with the residual substituted, the gradients equal the full recompute's up to the
rounding of that residual, which the forward computed without grad (its attention may take a
different kernel than a call with grad): `tests/test_attention_residual.py`. The o_proj flag is
set only while a residual is substituted, never by `frozen_tail.unread_tail` alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.model.chunked_layer import MIN_TOKENS
from roundpipe.model.frozen_tail import TAIL_LAYERS, frozen_linear, transformers_names, unread_linear_methods
from roundpipe.model.swap_class import subclass_of

OFF, KEEP, USE = 0, 1, 2
_MARKER = "_roundpipe_attention_tail"  # not `frozen_tail.tails`'s: flagged only by `using`
_READIED = "_roundpipe_residual_parts"  # on a readied layer: its (norm, o_proj linear)
_subclasses: dict[type, type] = {}


@dataclass
class ResidualSlot:
    """One layer call's residual: empty, the call keeps it here (a forward stage); holding one,
    the call uses it (a recompute). A layer that cannot leaves it as it was."""

    value: torch.Tensor | None = None


class _Substitute(torch.autograd.Function):
    """``saved``'s value, with the gradient going to ``computed`` (which it stands for)."""

    @staticmethod
    def forward(ctx: Any, computed: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return saved.view_as(saved)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _residual_hook(norm: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    mode = getattr(norm, "residual_mode", OFF)
    if mode == KEEP:
        norm.residual_store.append(args[0].detach())
        return None
    if mode == USE:
        return (_Substitute.apply(args[0], norm.residual_store[0]), *args[1:])
    return None


def _parts(layer: nn.Module) -> tuple[Any, nn.Module] | None:
    """(``post_attention_layernorm``, ``o_proj``'s frozen linear) of a layer this module serves
    (the norm as Any: its ``residual_*`` attributes are this module's own)."""
    if not transformers_names(layer) & TAIL_LAYERS:
        return None
    norm = getattr(layer, "post_attention_layernorm", None)
    o_proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
    if not isinstance(norm, nn.Module) or not isinstance(o_proj, nn.Module):
        return None
    linear = frozen_linear(o_proj, _MARKER)
    return None if linear is None else (norm, linear)


def supported(module: nn.Module) -> bool:
    """Whether a decoder layer within ``module`` (the user's, not yet readied) can keep one."""
    return any(_parts(m) is not None for m in module.modules())


def install(layer: nn.Module) -> bool:
    """Ready roundpipe's copy of a decoder layer to keep and use its residual (module docstring);
    whether it can."""
    parts = _parts(layer)
    if parts is None:
        return False
    norm, linear = parts
    if not getattr(type(linear), _MARKER, False):
        methods = lambda base: unread_linear_methods(base, _MARKER)  # noqa: E731
        linear.__class__ = subclass_of(_subclasses, type(linear), "UnreadAttentionTail", methods)
    setattr(linear, "output_unread", False)  # noqa: B010 (the copy's own from the start)
    if getattr(norm, "residual_store", None) is None:
        norm.register_forward_pre_hook(_residual_hook)
        norm.residual_store = []
    norm.residual_mode = OFF
    # Found once: a call's `kept_or_used` reads them on the host path of every layer call.
    object.__setattr__(layer, _READIED, (norm, linear))
    return True


def installed(layer: nn.Module) -> bool:
    """Whether `install` readied ``layer``."""
    return getattr(layer, _READIED, None) is not None


def _readied(layer: nn.Module) -> tuple[Any, nn.Module]:
    parts: tuple[Any, nn.Module] | None = getattr(layer, _READIED, None)
    if parts is None:
        raise ValueError(f"a {type(layer).__name__} that attention_residual.install() did not ready")
    return parts


@contextmanager
def keeping(layer: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While inside, a call of ``layer`` (an `installed` one) appends its post-attention residual
    to the list yielded."""
    norm, _ = _readied(layer)
    kept: list[torch.Tensor] = []
    norm.residual_mode = KEEP
    try:
        yield kept
    finally:
        kept.extend(norm.residual_store)
        norm.residual_store.clear()
        norm.residual_mode = OFF


@contextmanager
def using(layer: nn.Module, residual: torch.Tensor) -> Iterator[None]:
    """While inside, a call of ``layer`` with grad takes ``residual`` as its post-attention
    residual and leaves out ``o_proj``'s frozen product (module docstring)."""
    norm, linear = _readied(layer)
    norm.residual_store.append(residual)
    norm.residual_mode = USE
    setattr(linear, "output_unread", True)  # noqa: B010
    try:
        yield
    finally:
        setattr(linear, "output_unread", False)  # noqa: B010
        norm.residual_mode = OFF
        norm.residual_store.clear()


@contextmanager
def kept_or_used(layer: nn.Module, hidden: torch.Tensor, slot: ResidualSlot | None) -> Iterator[None]:
    """While inside, a call of ``layer`` on ``hidden`` keeps its residual in ``slot`` (empty) or
    uses the one it holds. A layer `install` did not ready, or a row long enough to run a slice at
    a time (`roundpipe.model.chunked_layer`, whose slices call the norm once each), leaves
    ``slot`` as it was and computes in full."""
    if slot is None or not installed(layer) or hidden.shape[-2] >= MIN_TOKENS:
        yield
    elif slot.value is not None:
        with using(layer, slot.value):
            yield
    else:
        with keeping(layer) as kept:
            yield
        slot.value = kept[0] if len(kept) == 1 else None


__all__ = ["ResidualSlot", "install", "installed", "keeping", "kept_or_used", "supported", "using"]
