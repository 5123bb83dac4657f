"""A recompute leaves out the frozen product at the end of a layer whose output nothing reads.

Why: a backward stage recomputes its layers' forward to get what their backward needs, then
back-propagates from the stage's output. The last layer's output is only the root of that
backward: its value is never read. In a Llama-style decoder layer the last thing computed is
``residual + mlp.down_proj(h)``, and with a frozen ``down_proj`` (LoRA, QLoRA) nothing in the
backward needs that product's result either: the gradient of its input is ``grad @ W``, which needs
the weight, not the output, and the residual sum passes the gradient through unchanged. So the
recompute of that layer can skip the product, about a quarter of a decoder layer's matrix work
(Qwen3-32B: 5,120 x 25,600 of 487.5M weights a token; Llama-3.1-70B: 235M of 855M). Every
layer's recompute gets that where the layer is recomputed from its own input (backward stages of
one layer, or ``recompute_grain="layer"`` or ``"layer_input"``); a stage of several layers gets
it once, for its last.

How: `mark_tail` finds the tail of a decoder layer it knows to end that way (`TAIL_LAYERS`, with
an MLP of `TAIL_MLPS`) and gives that linear (peft's base layer, when LoRA wraps ``down_proj``;
`roundpipe.model.quant.NF4Linear` for a 4-bit base) a subclass whose forward, while its
``output_unread`` flag is set (`unread_tail`), returns zeros of the output's shape through
`_UnreadProduct`, whose backward is the product's own input gradient. Only roundpipe's copies of
a layer are swapped, and the flag is set only around a recompute call whose output is a
backward's root. A long row's sliced paths (`roundpipe.model.chunked_mlp`,
`roundpipe.model.chunked_layer`) checkpoint their slices and recompute them again in the
backward, where the flag is off: they clear it for their own forward (`outputs_read`) so both
passes compute the same.

A mixture-of-experts layer (Qwen3-MoE, GPT-OSS) ends ``residual + experts(h)``; its frozen
grouped experts are its tail, and they leave out their down products and the sum of each token's
choices (`roundpipe.model.experts_tail`, which says what its gradients need instead).

What holds: every gradient equals what the full recompute gives, bit for bit (the skipped value
is read by nothing; `tests/test_frozen_tail.py` compares the two, and the pipeline parity tests
run with it on). A weight that trains, a bias that trains, a layer or MLP class not listed, or a
wrapper other than plain peft LoRA (DoRA reads the base output) keeps its product. The experts'
tail gives the same gradients up to the order of fp32 sums, not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from roundpipe.model.nf4 import NF4Weight, dequantize_nf4
from roundpipe.model.quant import NF4Linear
from roundpipe.model.swap_class import subclass_of

# Decoder layers whose forward ends ``hidden = residual + self.mlp(post_attention_layernorm(hidden))``
# and MLPs whose forward ends ``self.down_proj(...)`` (transformers' own classes, checked by name).
TAIL_LAYERS = frozenset(
    {
        "LlamaDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "MistralDecoderLayer",
        "Qwen3MoeDecoderLayer",
        "GptOssDecoderLayer",
    }
)
TAIL_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Qwen3MoeMLP"})
# Mixture-of-experts blocks whose output is their ``experts`` module's (reshaped; GPT-OSS's also
# returns the router's scores, which its decoder layer drops): `roundpipe.model.experts_tail`.
TAIL_EXPERT_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "GptOssMLP"})
_Method = TypeVar("_Method", bound=Callable[..., Any])


class _UnreadProduct(torch.autograd.Function):
    """Zeros where ``x @ W.T`` would be, with that product's input gradient ``grad @ W``: for a
    product whose value nothing reads. ``weight`` is the dense [out, in] weight, or None with
    ``nf4`` holding the 4-bit bytes (packed, absmax, meta, compiled) to dequantize in the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, out_features: int, nf4: tuple[Any, ...] | None
    ) -> torch.Tensor:
        if weight is not None:
            ctx.save_for_backward(weight)
        else:
            assert nf4 is not None
            ctx.save_for_backward(nf4[0], nf4[1])
            ctx.nf4_meta, ctx.nf4_compiled = nf4[2], nf4[3]
        ctx.dense = weight is not None
        return x.new_zeros(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if ctx.dense:
            (weight,) = ctx.saved_tensors
        else:
            packed, absmax = ctx.saved_tensors
            q = NF4Weight(packed, absmax, *ctx.nf4_meta)
            weight = dequantize_nf4(q, grad.dtype, compiled=ctx.nf4_compiled and grad.is_cuda)
        return grad @ weight.to(grad.dtype), None, None, None


def _frozen(module: nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters(recurse=False))


def _unread_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`_UnreadProduct` for the tail ``module`` (a linear, or an NF4Linear with or without a
    stage run's dense copy bound)."""
    weight: torch.Tensor | None = getattr(module, "weight", None)
    out_features = int(getattr(module, "out_features"))  # noqa: B009
    nf4: tuple[Any, ...] | None = None
    if isinstance(module, NF4Linear):
        dense: torch.Tensor | None = getattr(module, "dense", None)
        if dense is not None and dense.numel():
            weight = dense
        else:
            q = module.quantized()
            nf4 = (q.packed, q.absmax, (q.shape, q.dtype, q.block_size), module.compiled)
    out: torch.Tensor = _UnreadProduct.apply(x, weight, out_features, nf4)
    return out


_subclasses: dict[type, type] = {}
TAIL_MARKER = "_roundpipe_tail"
"""The class attribute of a marked tail's subclass (`mark_tail`, `tails`)."""


def unread_linear_methods(base: type, marker: str = TAIL_MARKER) -> dict[str, Any]:
    """The methods of a frozen linear's subclass that returns `_UnreadProduct` in a call with grad
    while its ``output_unread`` flag is set; ``marker``, a class attribute, says which kind of tail
    it is (`tails` lists those of the default one)."""
    original: Any = getattr(base, "forward")  # noqa: B009 (a module class; mypy sees a plain type)

    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "output_unread", False) and not args and not kwargs and torch.is_grad_enabled():
            return _unread_output(self, x)
        return original(self, x, *args, **kwargs)

    # The flag itself is the copy's own, off from marking on (`mark_tail`).
    return {"forward": forward, marker: True, "__module__": base.__module__}


def _experts_methods(base: type) -> dict[str, Any]:
    """Grouped experts read the flag themselves (`roundpipe.model.experts.grouped_experts`)."""
    return {TAIL_MARKER: True, "__module__": base.__module__}


def _plain_lora(wrapper: nn.Module) -> bool:
    """Whether ``wrapper`` is peft's LoRA linear that adds ``B(A(x))`` to its base output and reads
    that output nowhere else: DoRA and peft's other variants (and other tuners, such as IA3 on an
    output) scale it by trained values, whose gradients need it."""
    if not type(wrapper).__module__.startswith("peft.tuners.lora."):
        return False
    if getattr(wrapper, "lora_variant", None):
        return False
    use_dora = getattr(wrapper, "use_dora", {})
    return not any(use_dora.values()) if isinstance(use_dora, dict) else not use_dora


def transformers_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__ if cls.__module__.startswith("transformers.")}


def _tail_of(layer: nn.Module) -> nn.Module | None:
    """The frozen linear, or the frozen grouped experts, at the end of ``layer`` (module
    docstring), else None."""
    mlp = getattr(layer, "mlp", None)
    if not transformers_names(layer) & TAIL_LAYERS or not isinstance(mlp, nn.Module):
        return None
    if transformers_names(mlp) & TAIL_EXPERT_BLOCKS:
        return _experts_tail(mlp)
    tail = getattr(mlp, "down_proj", None)
    if not transformers_names(mlp) & TAIL_MLPS or not isinstance(tail, nn.Module):
        return None
    return frozen_linear(tail, TAIL_MARKER)


def frozen_linear(module: nn.Module, marker: str) -> nn.Module | None:
    """The frozen linear that computes ``module``'s product (``module`` itself, or the base of
    plain peft LoRA around it; one already marked with ``marker`` counts), else None: a weight or
    bias that trains, a variant of LoRA that reads the base output, or another kind of module."""
    base = getattr(module, "base_layer", None)  # peft's LoRA layer wraps the frozen linear
    if isinstance(base, nn.Module):
        if not _plain_lora(module):
            return None
        module = base
    dense_linear = type(module) is nn.Linear or getattr(type(module), marker, False)
    if not (dense_linear or isinstance(module, NF4Linear)) or not _frozen(module):
        return None
    return module


def _experts_tail(block: nn.Module) -> nn.Module | None:
    """``block.experts`` when it runs roundpipe's grouped products (`roundpipe.model.experts`,
    which takes the unread path) and nothing in it trains or is computed by a parametrization."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or not getattr(type(experts), "_roundpipe_grouped", False):
        return None
    if torch.nn.utils.parametrize.is_parametrized(experts):
        return None
    return experts if not any(p.requires_grad for p in experts.parameters()) else None


def dense_tail_width(layers: Sequence[nn.Module]) -> int:
    """The narrowest output of the frozen dense (or 4-bit) linears that end the decoder layers within
    ``layers`` (a pipeline's layers, each holding at most a few), or 0 when there is no decoder
    layer or one ends otherwise (a trained projection, experts, a class not listed)."""
    decoders = [m for layer in layers for m in layer.modules() if transformers_names(m) & TAIL_LAYERS]
    widths = []
    for layer in decoders:
        tail = _tail_of(layer)
        if tail is None or getattr(type(tail), "_roundpipe_grouped", False):
            return 0
        widths.append(int(getattr(tail, "out_features", 0)))
    return min(widths, default=0)


def mark_tail(layer: nn.Module) -> bool:
    """Give the frozen tail of ``layer`` (roundpipe's copy) the class that can skip its product;
    whether ``layer`` has one."""
    tail = _tail_of(layer)
    if tail is None:
        return False
    if not getattr(type(tail), TAIL_MARKER, False):
        methods = (
            _experts_methods if getattr(type(tail), "_roundpipe_grouped", False) else unread_linear_methods
        )
        tail.__class__ = subclass_of(_subclasses, type(tail), "UnreadTail", methods)
    # Off, and an attribute of the copy from the start (`unread_tail` turns it on for one call):
    # torch.compile guards on the flag's value where it is one, else on its absence, so a tail
    # flagged once and set back would no longer match the code compiled before (one more compile
    # of the layer, whenever a plan first skips its tail).
    setattr(tail, "output_unread", False)  # noqa: B010
    return True


def tails(module: nn.Module) -> list[nn.Module]:
    """The marked tails within ``module``."""
    return [m for m in module.modules() if getattr(type(m), TAIL_MARKER, False)]


@contextmanager
def _flagged(marked: list[nn.Module], unread: bool) -> Iterator[None]:
    """``output_unread`` set to ``unread`` on the ``marked`` tails while inside, then back to what
    each held."""
    held = [bool(getattr(tail, "output_unread", False)) for tail in marked]
    for tail in marked:
        setattr(tail, "output_unread", unread)  # noqa: B010 (a plain attribute)
    try:
        yield
    finally:
        for tail, was in zip(marked, held, strict=True):
            setattr(tail, "output_unread", was)  # noqa: B010


def unread_tail(marked: list[nn.Module]) -> AbstractContextManager[None]:
    """While inside, the ``marked`` tails (`tails` of a layer) skip their product in a call with
    grad: for a call whose output is only a backward's root."""
    return _flagged(marked, True)


def outputs_read(module: nn.Module) -> AbstractContextManager[None]:
    """While inside, every marked tail within ``module`` computes its product (a sliced path that
    checkpoints and recomputes its slices later, with the flag off)."""
    return _flagged([t for t in tails(module) if getattr(t, "output_unread", False)], False)


def reading_outputs(method: _Method) -> _Method:
    """``method(self, ...)`` under `outputs_read` of ``self``: for a sliced path's forward."""

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with outputs_read(self):
            return method(self, *args, **kwargs)

    return wrapped  # type: ignore[return-value]
