"""A mixture-of-experts layer's experts as grouped matrix products.

Why: transformers' eager experts loop over the experts in Python: a one-hot mask, ``nonzero()``
to find the experts hit, and per expert a ``where``, a gather and three small matrix products.
Each ``nonzero``/``where`` waits for the device, so a 128-expert layer stops the host 128 times
per call, and the small products leave the GPU idle. Here the routed (token, expert) pairs are
sorted by expert once, the offsets of each expert's rows are computed on the device
(``searchsorted`` on the sorted ids; `roundpipe.model.routing`), and each projection is one
``torch.nn.functional.grouped_mm`` over all experts. Nothing in this path reads a tensor's value
on the host: no ``.item()``, ``.tolist()``, ``nonzero()`` or branch on data, so the host issues a
whole layer without waiting (tests/test_moe_experts.py checks it).

What runs it: `use_grouped_experts` swaps the class of the known experts modules (`LAYOUTS`) in
roundpipe's own copies of a layer for a subclass with this forward (the same parameters, names and
state dict), whatever ``config._experts_implementation`` says, except an explicitly chosen kernel
outside transformers' built-in ones, which is left alone. The router (its gradient) and the
router auxiliary loss are the model's own (`roundpipe.model.moe`); only the experts change.

Kernels: ``grouped_mm`` runs on CPU (torch >= 2.9, any float dtype) and on CUDA in bf16 on sm90+
without any host round trip. On CUDA in other dtypes torch falls back to a loop that copies the
offsets to the host once per product (two per layer forward, not one per expert). Widths and base
pointers the kernel refuses are made fit in `roundpipe.model.grouped_mm`, which also offers the
product as an operator of roundpipe's own for layers compiled with inductor's C++ wrapper
(`dispatch_products`).

Frozen experts in 4 bits: `quantize_experts_` (what `roundpipe.model.quant.quantize_frozen_`
calls for ``base_format="nf4"``) replaces the 3-D ``gate_up_proj`` / ``down_proj`` of frozen
experts by NF4 bytes (``<name>_packed`` and ``<name>_absmax``, frozen ``uint8`` parameters laid out
as `roundpipe.model.nf4.quantize_nf4` lays out the flattened weight, one row per expert) and gives
the module a subclass whose grouped products dequantize each weight on the device, right before
its product (`roundpipe.model.expert_products`, which decides the form every product reads):
autograd saves the 4-bit bytes, and the backward dequantizes again, so no dense expert weight
outlives its product. GPT-OSS's biases stay as they are.

A recompute whose output nothing reads (`roundpipe.model.frozen_tail`) leaves out the down
products and the sum of the choices: `roundpipe.model.experts_tail`.

This module must never change the routing, the user's model (only roundpipe's copies; the one
exception is `quantize_experts_`, which the user's choice of a 4-bit base asks for), or the
numbers beyond the blocking of the matrix products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from roundpipe.model import choice_sum
from roundpipe.model.expert_products import NF4Meta, dense_weight, project
from roundpipe.model.experts_tail import unread_experts
from roundpipe.model.nf4 import quantize_nf4
from roundpipe.model.routing import gather_rows, inverse_order, route, sort_choices, unsort_rows
from roundpipe.model.swap_class import subclass_of

# Implementations transformers builds in; another name is a kernel the user chose, left alone.
REPLACEABLE = frozenset({None, "eager", "grouped_mm", "batched_mm"})


def _swiglu_halves(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: ``[gate; up]`` concatenated, ``act(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    act: Any = experts.act_fn
    return act(gate) * up


def _gpt_oss_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: gate and up interleaved, clamped, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    limit, alpha = float(getattr(experts, "limit")), float(getattr(experts, "alpha"))  # noqa: B009
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class Layout:
    """How an experts class stores its weights: ``transposed`` = ``[E, in, out]`` (else
    ``[E, out, in]``), per-expert biases ``<name>_bias``, and its gated activation."""

    transposed: bool
    bias: bool
    gate: Callable[[nn.Module, torch.Tensor], torch.Tensor]


LAYOUTS: dict[str, Layout] = {
    "Qwen3MoeExperts": Layout(transposed=False, bias=False, gate=_swiglu_halves),
    "GptOssExperts": Layout(transposed=True, bias=True, gate=_gpt_oss_gate),
}


def layout_of(module: nn.Module) -> Layout | None:
    """The layout of ``module`` when it is (or derives from) a known transformers experts class."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in LAYOUTS:
            return LAYOUTS[cls.__name__]
    return None


def grouped_experts(
    experts: nn.Module,
    layout: Layout,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts' output for ``hidden`` [tokens, H] routed to ``top_k_index`` [tokens, k] with
    ``top_k_weights``: what the eager loop computes, as two grouped products."""
    tokens, k = top_k_index.shape
    routing = route(top_k_index, int(getattr(experts, "num_experts")))  # noqa: B009
    inverse = inverse_order(routing)
    rows = gather_rows(hidden, routing, inverse, k)
    stored = {"transposed": layout.transposed, "bias": layout.bias}  # how the weights are laid out
    inner = layout.gate(experts, project(experts, "gate_up_proj", rows, routing, **stored))
    if getattr(experts, "output_unread", False) and torch.is_grad_enabled():  # `experts_tail`
        return unread_experts(experts, inner, top_k_weights, routing, inverse, hidden, **stored)
    out = project(experts, "down_proj", inner, routing, **stored)
    if choice_sum.in_use(out):  # one kernel reads the k rows of a token and weighs and sums them
        return choice_sum.choice_sum(out, inverse, top_k_weights, k).to(hidden.dtype)
    out = out * sort_choices(top_k_weights, routing, inverse).unsqueeze(-1).to(out.dtype)
    # Back to (token, choice) order, then the k choices of a token summed: a fixed order, unlike
    # an index_add_ whose float atomics on CUDA add in a different order every run (the
    # gradients of the permutations are gathers too: `roundpipe.model.routing`).
    return unsort_rows(out, routing, inverse).view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def fits(experts: nn.Module, layout: Layout) -> bool:
    """Whether ``experts`` holds its weights as ``layout`` says (shapes only, no values read):
    another transformers version may lay them out otherwise, and then its own forward runs."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not isinstance(getattr(experts, "num_experts", None), int):
        return False
    if layout.transposed:  # [E, H, 2I] and [E, I, H]
        shapes_fit = gate_up.shape[1] == down.shape[2] and gate_up.shape[2] == 2 * down.shape[1]
    else:  # [E, 2I, H] and [E, H, I]
        shapes_fit = gate_up.shape[2] == down.shape[1] and gate_up.shape[1] == 2 * down.shape[2]
    needs: tuple[str, ...] = ("gate_up_proj_bias", "down_proj_bias") if layout.bias else ()
    needs += ("limit", "alpha") if layout.gate is _gpt_oss_gate else ("act_fn",)
    return shapes_fit and gate_up.shape[0] == down.shape[0] and all(hasattr(experts, n) for n in needs)


_subclasses: dict[type, type] = {}


def _grouped_methods(base: type, layout: Layout) -> dict[str, Any]:
    original: Any = getattr(base, "forward")  # noqa: B009 (a module class; mypy sees a plain type)

    def forward(self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> Any:
        if not fits(self, layout):
            return original(self, hidden, index, weights)
        return grouped_experts(self, layout, hidden, index, weights)

    return {"forward": forward, "_roundpipe_grouped": True, "__module__": base.__module__}


def use_grouped_experts(layer: nn.Module) -> int:
    """Make every known experts module inside ``layer`` run `grouped_experts` (in place, for
    roundpipe's copies only); the number of modules that run it."""
    count = 0
    for module in layer.modules():
        if getattr(type(module), "_roundpipe_grouped", False):
            count += 1
            continue
        layout = layout_of(module)
        chosen = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if layout is None or chosen not in REPLACEABLE:
            continue
        module.__class__ = subclass_of(
            _subclasses, type(module), "Grouped", partial(_grouped_methods, layout=layout)
        )
        count += 1
    return count


def dispatch_products(layer: nn.Module) -> int:
    """Make the grouped experts inside ``layer`` (roundpipe's copy) call their products as the
    operator ``roundpipe::grouped_mm``, which inductor's C++ wrapper can call
    (`roundpipe.model.grouped_mm`); the number of experts modules that do."""
    count = 0
    for module in layer.modules():
        if getattr(type(module), "_roundpipe_grouped", False):
            setattr(module, "dispatch_products", True)  # noqa: B010 (a plain attribute)
            count += 1
    return count


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_nf4_subclasses: dict[type, type] = {}


def _nf4_methods(base: type, layout: Layout) -> dict[str, Any]:
    """Methods of a subclass of ``base`` that runs `grouped_experts` on its NF4 weights (and tells
    the profile the bytes of the dense weight one product holds transiently)."""

    def forward(self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> Any:
        return grouped_experts(self, layout, hidden, index, weights)

    def dequantized_bytes(self: nn.Module, dtype: torch.dtype) -> int:
        meta: dict[str, NF4Meta] = getattr(self, "nf4_meta")  # noqa: B009
        return max(m.numel for m in meta.values()) * torch.empty(0, dtype=dtype).element_size()

    return {
        "forward": forward,
        "dequantized_bytes": dequantized_bytes,
        "_roundpipe_grouped": True,
        "_roundpipe_nf4": True,
        # As `NF4Linear.compiled`: dequantize with one torch.compile'd kernel on CUDA.
        "compiled": False,
        "__module__": base.__module__,
    }


def quantizable_experts(module: nn.Module, block_size: int) -> Layout | None:
    """The layout of ``module`` when it is a known experts module whose two weights are frozen
    parameters (not computed by a parametrization), floating, laid out as the layout says, and
    hold a whole number of NF4 blocks per expert."""
    layout = layout_of(module)
    if layout is None or getattr(type(module), "_roundpipe_nf4", False) or not fits(module, layout):
        return None
    if torch.nn.utils.parametrize.is_parametrized(module):  # peft's LoRA on experts computes them
        return None
    weights: list[torch.Tensor] = [getattr(module, name) for name in EXPERT_WEIGHTS]
    if any(w.requires_grad or not w.is_floating_point() or w[0].numel() % block_size for w in weights):
        return None
    return layout


@torch.no_grad()
def quantize_experts_(module: nn.Module, block_size: int) -> bool:
    """Hold the frozen expert weights of ``module`` in NF4 (in place, on their device), one expert
    at a time so the quantization scratch stays that of one matrix; whether it did. Each dense
    weight leaves the module as its bytes are made, so the module never holds both."""
    layout = quantizable_experts(module, block_size)
    if layout is None:
        return False
    meta: dict[str, NF4Meta] = {}
    for name in EXPERT_WEIGHTS:
        weight: torch.Tensor = getattr(module, name)
        experts, per_expert = weight.shape[0], weight[0].numel()
        packed = torch.empty(experts, per_expert // 2, dtype=torch.uint8, device=weight.device)
        absmax = torch.empty(experts, per_expert // block_size, dtype=torch.float32, device=weight.device)
        for e in range(experts):
            q = quantize_nf4(weight[e], block_size)
            packed[e].copy_(q.packed)
            absmax[e].copy_(q.absmax)
        meta[name] = NF4Meta(weight.shape, weight.dtype, block_size)
        delattr(module, name)
        del weight
        module.register_parameter(f"{name}_packed", nn.Parameter(packed, requires_grad=False))
        module.register_parameter(
            f"{name}_absmax", nn.Parameter(absmax.view(torch.uint8), requires_grad=False)
        )
    # Plain attributes (no parameters): copies of the module (deepcopy) carry them.
    setattr(module, "nf4_meta", meta)  # noqa: B010
    setattr(module, "weight_dtype", meta["gate_up_proj"].dtype)  # noqa: B010
    module.__class__ = subclass_of(_nf4_subclasses, type(module), "NF4", partial(_nf4_methods, layout=layout))
    return True


def dequantized_experts(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The dense expert weights of a module `quantize_experts_` quantized, by name, in their stored
    layout (new tensors; for inspection, export and tests)."""
    meta: dict[str, NF4Meta] = getattr(module, "nf4_meta")  # noqa: B009
    return {
        name: dense_weight(
            getattr(module, f"{name}_packed"), getattr(module, f"{name}_absmax"), m, dtype or m.dtype, False
        ).view(m.shape)
        for name, m in meta.items()
    }
