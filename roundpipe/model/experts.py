"""A mixture-of-experts layer's experts as grouped matrix products.

Why: transformers' eager experts loop over the experts in Python: a one-hot mask, ``nonzero()``
to find the experts hit, and per expert a ``where``, a gather and three small matrix products.
Each ``nonzero``/``where`` waits for the device, so a 128-expert layer stops the host 128 times
per call, and the small products leave the GPU idle. Here the routed (token, expert) pairs are
sorted by expert once, the offsets of each expert's rows are computed on the device
(``searchsorted`` on the sorted ids), and each projection is one ``torch.nn.functional.grouped_mm``
over all experts. Nothing in this path reads a tensor's value on the host: no ``.item()``,
``.tolist()``, ``nonzero()`` or branch on data, so the host issues a whole layer without waiting
(tests/test_moe_experts.py checks it).

What runs it: `use_grouped_experts` swaps the class of the known experts modules (`LAYOUTS`) in
roundpipe's own copies of a layer for a subclass with this forward (the same parameters, names and
state dict), whatever ``config._experts_implementation`` says, except an explicitly chosen kernel
outside transformers' built-in ones, which is left alone. The router (its gradient) and the
router auxiliary loss are the model's own (`roundpipe.model.moe`); only the experts change.

Kernels: ``grouped_mm`` runs on CPU (torch >= 2.9, any float dtype) and on CUDA in bf16 on sm90+
without any host round trip. On CUDA in other dtypes torch falls back to a loop that copies the
offsets to the host once per product (two per layer forward, not one per expert). The kernel wants
16-byte strides and base pointers: a dimension that is not a multiple of 16 bytes is padded with
zeros (exact; real models never need it), a misaligned base pointer is copied to a fresh tensor.

This module must never change the routing, the user's model (only roundpipe's copies), or the
numbers beyond the blocking of the matrix products.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Implementations transformers builds in; another name is a kernel the user chose, left alone.
REPLACEABLE = frozenset({None, "eager", "grouped_mm", "batched_mm"})
ALIGN_BYTES = 16
# torch >= 2.10 names it in torch.nn.functional; 2.9 has only the private op, the same kernel.
_GROUPED_MM: Any = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")  # noqa: B009


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


@dataclass(frozen=True)
class Routing:
    """The routed (token, expert) pairs sorted by expert: ``order`` (pair index in sorted order),
    ``token`` (its token row), ``expert`` (its expert id) and ``offsets`` (int32, the end of
    each expert's rows), all on the device."""

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    offsets: torch.Tensor


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the ``[tokens, k]`` choices by expert (stable: ties keep token order)."""
    k = top_k_index.shape[-1]
    expert, order = torch.sort(top_k_index.reshape(-1), stable=True)
    bounds = torch.arange(1, num_experts + 1, device=expert.device, dtype=expert.dtype)
    offsets = torch.searchsorted(expert, bounds, out_int32=True)
    return Routing(order, torch.div(order, k, rounding_mode="floor"), expert, offsets)


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, missing]
    return F.pad(t, pads)


def _aligned_size(size: int, element_size: int) -> int:
    step = max(1, ALIGN_BYTES // element_size)
    return -(-size // step) * step


def _aligned_base(t: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() or t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e]`` for every expert e: ``x`` [S, in] sorted by expert,
    ``weight`` [E, in, out] (any strides), ``offsets`` [E] int32 row ends."""
    x = x.to(weight.dtype)
    size = weight.element_size()
    d_in, d_out = weight.shape[1], weight.shape[2]
    p_in, p_out = _aligned_size(d_in, size), _aligned_size(d_out, size)
    if (p_in, p_out) != (d_in, d_out):
        x = _pad_to(x, 1, p_in)
        weight = _pad_to(_pad_to(weight, 1, p_in), 2, p_out)
    out = _GROUPED_MM(_aligned_base(x.contiguous()), _aligned_base(weight), offs=offsets)
    return out[:, :d_out] if p_out != d_out else out


def _projection(
    experts: nn.Module, name: str, layout: Layout, x: torch.Tensor, routing: Routing
) -> torch.Tensor:
    weight: torch.Tensor = getattr(experts, name)
    mat_b = weight if layout.transposed else weight.transpose(-2, -1)
    out = grouped_mm(x, mat_b, routing.offsets)
    if layout.bias:
        bias: torch.Tensor = getattr(experts, f"{name}_bias")
        out = out + bias[routing.expert].to(out.dtype)
    return out


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
    rows = hidden[routing.token]
    inner = layout.gate(experts, _projection(experts, "gate_up_proj", layout, rows, routing))
    out = _projection(experts, "down_proj", layout, inner, routing)
    out = out * top_k_weights.reshape(-1)[routing.order].unsqueeze(-1).to(out.dtype)
    # Back to (token, choice) order, then the k choices of a token summed: a fixed order, unlike
    # an index_add_ whose float atomics on CUDA add in a different order every run.
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=inverse.device)
    return out[inverse].view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


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


def _grouped_class(base: type, layout: Layout) -> type:
    subclass = _subclasses.get(base)
    if subclass is None:
        original: Any = getattr(base, "forward")  # noqa: B009 (a module class; mypy sees a plain type)

        def forward(self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> Any:
            if not fits(self, layout):
                return original(self, hidden, index, weights)
            return grouped_experts(self, layout, hidden, index, weights)

        methods = {"forward": forward, "_roundpipe_grouped": True, "__module__": base.__module__}
        subclass = _subclasses[base] = type(f"Grouped{base.__name__}", (base,), methods)
    return subclass


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
        module.__class__ = _grouped_class(type(module), layout)
        count += 1
    return count
