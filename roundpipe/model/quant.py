"""4-bit NormalFloat (NF4) frozen weights: the layer that holds one, the model pass.

Why it exists: when the base of a LoRA run is frozen, every iteration moves every base weight over
the host link at least twice, so the bytes a frozen weight occupies on the host *are* the bytes that
travel. Holding the base in NF4 (QLoRA's 4-bit NormalFloat, 16 code values, one fp32 scale per block
of 64) moves about a quarter of a bf16 base. The layout is the one bitsandbytes uses for
``quant_type="nf4"``: the weight flattened row-major, two codes per byte with the first element in
the high nibble, and the absolute maximum of each block as its scale, so the same bytes mean the
same weights in both. The format itself is `roundpipe.model.nf4` (its names are re-exported here);
frozen mixture-of-experts weights are held in it by `roundpipe.model.experts.quantize_experts_`,
which `quantize_frozen_` calls.

`NF4Linear` keeps its 4-bit weight as two frozen ``uint8`` parameters (the packed codes, and the
fp32 block scales stored as their raw bytes): integer tensors are never cast to the compute
precision, by ``module.to(dtype)`` nor by the host copies, so they travel exactly as they are, and
the layer dequantizes on the device of its input, inside its own call. Its backward re-dequantizes
instead of saving the dequantized weight, so a layer call never keeps a full-precision copy of its
base. A run may instead bind a dense copy it made once for a whole stage run
(`roundpipe.model.dense_weights`, ``RunConfig.dequantize``): the layer then computes with it.

This module must never train a quantized weight, keep a dequantized copy itself, or build a
second full copy of a model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.errors import ConfigError, ModelError
from roundpipe.model.experts import quantize_experts_
from roundpipe.model.nf4 import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from roundpipe.model.nf4 import NF4_CODES as NF4_CODES
from roundpipe.model.nf4 import NF4Weight as NF4Weight
from roundpipe.model.nf4 import check_quantizable as check_quantizable
from roundpipe.model.nf4 import dequantize_nf4 as dequantize_nf4
from roundpipe.model.nf4 import quantize_nf4 as quantize_nf4

BASE_FORMATS = ("compute", "nf4")


class _NF4Matmul(torch.autograd.Function):
    """``x @ W.T + b`` with W dequantized in the forward and again in the backward: autograd saves
    the 4-bit bytes (already on the device for the stage), never the dense weight. No gradient
    reaches the frozen weight or bias."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        bias: torch.Tensor | None,
        meta: tuple[torch.Size, torch.dtype, int],
        compiled: bool,
    ) -> torch.Tensor:
        weight = dequantize_nf4(NF4Weight(packed, absmax, *meta), x.dtype, compiled=compiled and x.is_cuda)
        ctx.save_for_backward(packed, absmax)
        ctx.meta, ctx.compiled = meta, compiled
        return F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        packed, absmax = ctx.saved_tensors
        q = NF4Weight(packed, absmax, *ctx.meta)
        weight = dequantize_nf4(q, grad.dtype, compiled=ctx.compiled and grad.is_cuda)
        return grad @ weight, None, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is held in NF4 (and an optional frozen bias).

    Parameters (all ``requires_grad=False``): ``packed`` uint8 [out * in / 2], ``absmax`` uint8
    [4 * out * in / block_size] (the fp32 block scales as raw bytes, so that no dtype cast ever
    touches them), ``bias`` in its own precision. ``forward(x)`` dequantizes on ``x``'s device to
    ``x``'s dtype and applies ``F.linear``; with ``compiled`` (class attribute, or per layer) the
    dequantization is one ``torch.compile``d kernel on CUDA."""

    compiled: bool = False

    def __init__(self, q: NF4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if len(q.shape) != 2:
            raise ModelError(f"NF4Linear needs a 2-D weight, got shape {tuple(q.shape)}")
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1])
        self.block_size = q.block_size
        self.weight_dtype = q.dtype
        self.packed = nn.Parameter(q.packed, requires_grad=False)
        self.absmax = nn.Parameter(q.absmax.contiguous().view(torch.uint8), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int = DEFAULT_BLOCK_SIZE) -> NF4Linear:
        """``linear`` quantized on the device its weight is on (the original is left as it is)."""
        return cls(quantize_nf4(linear.weight, block_size), linear.bias)

    def quantized(self) -> NF4Weight:
        """The layer's weight as an `NF4Weight` (views of its parameters)."""
        shape = torch.Size((self.out_features, self.in_features))
        return NF4Weight(
            self.packed, self.absmax.view(torch.float32), shape, self.weight_dtype, self.block_size
        )

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight (a new tensor; for inspection, export and tests)."""
        return dequantize_nf4(self.quantized(), dtype)

    def dequantized_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the dense weight one call holds transiently, in ``dtype``."""
        return self.out_features * self.in_features * torch.empty(0, dtype=dtype).element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A stage run's dense copy, bound into the replica's ``dense`` slot (an empty placeholder
        # otherwise; the slot exists on the runtime's replicas only, `dense_weights.add_dense_slots`).
        dense = getattr(self, "dense", None)
        if dense is not None and dense.numel():
            return F.linear(x, dense, self.bias.to(x.dtype) if self.bias is not None else None)
        meta = (torch.Size((self.out_features, self.in_features)), self.weight_dtype, self.block_size)
        absmax = self.absmax.view(torch.float32)
        out: torch.Tensor = _NF4Matmul.apply(x, self.packed, absmax, self.bias, meta, self.compiled)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, nf4 block={self.block_size}"
        )


def _frozen_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` (subclasses may compute otherwise) with no trainable parameter."""
    return type(module) is nn.Linear and not any(p.requires_grad for p in module.parameters())


def kept_modules(model: nn.Module, include_lm_head: bool) -> set[int]:
    """Modules left alone: the output embeddings (unless asked for), and every linear whose weight
    another module also holds (a tied LM head: quantizing it would untie it)."""
    kept: set[int] = set()
    head = getattr(model, "get_output_embeddings", None)
    if callable(head) and not include_lm_head:
        try:
            found = head()
        except (AttributeError, NotImplementedError):
            found = None
        if found is not None:
            kept.add(id(found))
    holders: dict[int, set[int]] = {}
    for sub in model.modules():
        for param in sub.parameters(recurse=False):
            holders.setdefault(id(param), set()).add(id(sub))
    for sub in model.modules():
        if any(len(holders[id(p)]) > 1 for p in sub.parameters(recurse=False)):
            kept.add(id(sub))
    return kept


def quantize_frozen_(
    module: nn.Module,
    fmt: str = "nf4",
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    include_lm_head: bool = False,
) -> nn.Module:
    """Replace, in place, every frozen ``nn.Linear`` inside ``module`` by an `NF4Linear`, on the
    device its weight is on, and free each original as it goes (its parameters go to the meta
    device), so a model is never held twice. Returns ``module``.

    Quantized: plain ``nn.Linear`` modules whose weight (and bias) has ``requires_grad=False``,
    among them peft LoRA's ``base_layer``s (apply peft first: it does not wrap an `NF4Linear`).
    Left alone: embeddings, norms, every module with a trainable parameter (LoRA's own ``lora_A``
    / ``lora_B``), subclasses of ``nn.Linear``, a linear whose weight is shared with another module
    (a tied LM head), the LM head (``get_output_embeddings()``) unless ``include_lm_head``, and a
    weight whose element count is not a multiple of ``block_size``.

    Mixture-of-experts weights held as 3-D parameters (transformers 5's ``Qwen3MoeExperts`` and
    ``GptOssExperts``) are quantized too when both are frozen and each expert's matrix is a whole
    number of blocks (`roundpipe.model.experts.quantize_experts_`); their biases stay as they are."""
    if fmt != "nf4":
        raise ConfigError(f"unknown quantized base format {fmt!r}; the supported one is 'nf4'")
    for sub in list(module.modules()):
        quantize_experts_(sub, block_size)
    kept = kept_modules(module, include_lm_head)
    done: dict[int, NF4Linear] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if not isinstance(child, nn.Linear) or id(child) in kept or not _frozen_linear(child):
                continue
            if child.weight.numel() % block_size:
                continue
            replacement = done.get(id(child))
            if replacement is None:
                replacement = done[id(child)] = NF4Linear.from_linear(child, block_size)
                child.to("meta")  # frees the dense original now, not when the model is dropped
            setattr(parent, name, replacement)
    return module


def count_nf4(module: nn.Module) -> int:
    """How many modules of ``module`` hold NF4 weights: `NF4Linear` layers and experts modules
    quantized by `roundpipe.model.experts.quantize_experts_`."""
    return sum(
        isinstance(m, NF4Linear) or getattr(type(m), "_roundpipe_nf4", False) for m in module.modules()
    )


def apply_base_format(model: nn.Module, base_format: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """What ``RunConfig.base_format`` asks of a model, before its layers are split: "compute"
    leaves it as it is; "nf4" quantizes its frozen linears and experts (`quantize_frozen_`), or
    accepts a model that already holds NF4 weights, and refuses a model with nothing frozen to quantize."""
    if base_format not in BASE_FORMATS:
        raise ConfigError(f"unknown base_format {base_format!r}; use one of {', '.join(BASE_FORMATS)}")
    if base_format == "compute":
        return
    quantize_frozen_(model, base_format, block_size=block_size)
    if count_nf4(model) == 0:
        raise ConfigError(
            "base_format='nf4' found no frozen nn.Linear to quantize (every linear is trainable, or "
            f"none has a multiple of {block_size} elements): freeze the base, e.g. with a peft LoRA "
            "model, or leave base_format='compute' for a full fine-tune"
        )
