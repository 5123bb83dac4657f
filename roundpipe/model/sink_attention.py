"""Attention with sinks (GPT-OSS) through torch's fused attention instead of transformers' eager.

Why: GPT-OSS gives every head a learned sink, a logit that joins each query's softmax without a
value. transformers runs it eagerly (``eager_attention_forward``: the [heads, n, n] logits made,
concatenated with the sinks, softmaxed and multiplied out as separate kernels; no sdpa support),
and at 4 x 4096 tokens that is where a GPT-OSS-20B step's compute goes. The sink is one more key
whose logit is the same for every query: with one extra head dimension it is an ordinary key.
Queries get a 1 there, keys a 0, the sink key ``sink / scale`` (and zeros elsewhere), its value
zeros; then ``softmax(q'k'^T * scale + mask)`` over the n keys and the sink is exactly the eager
softmax with its sink column, and ``p'v'`` drops the sink's share as eager does. Head dimensions
are padded with zeros to a multiple of 8 (the fused kernels' tiles: 64 becomes 72). The mask the
model built (causal, sliding window, padding or packing; additive or boolean) gets one column that
always attends, so every mask the eager path honours is honoured. Gradients, the sinks' included,
come from autograd through these few tensor operations.

Without a mask (the rows neither padded nor packed: the embed layer's copy then carries none, see
`masks_implicit`) the mask is the module's own, causal and, on a sliding layer, its window, and a
second way is exact and cheaper: flash attention without the sink gives each query's output ``o``
and the log-sum-exp ``lse`` of its logits; the sink only adds ``exp(sink)`` to the softmax's
denominator, so the output is ``o * sigmoid(lse - sink)``. Backward: with ``w = sigmoid(lse -
sink)`` and the output's gradient ``g``, flash attention's backward takes ``g * w`` as its output
gradient and the sinked output in place of its own: the row sums it forms from the two,
``w^2 * rowsum(g * o)``, are exactly its usual term less the gradient through ``lse`` (``w * (1 -
w) * rowsum(g * o)``); the sink's gradient is minus the sum of that over the queries. So the
fused kernels run unchanged: causal and sliding windows skip the masked blocks (no mask tensor,
no padded head dimension) and grouped key/value heads are read as they are (`_flash_forward`:
flash attention on CUDA; torch's CPU flash kernel elsewhere, which CI runs).

What runs it: `use_sink_attention(layer)`, on roundpipe's copies of a decoder layer only, gives each
known sink attention module (`SINK_ATTENTIONS`) whose model chose eager attention a shallow copy of
its config asking for this function (registered with transformers' ``AttentionInterface`` as
``ATTENTION_NAME``); the user's model and its config are untouched. Calls with dropout run
transformers' eager function (sdpa's dropout would also drop the sink). Up to the blocking of the
products it must compute what the eager function computes, never anything else.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_NAME = "roundpipe_sdpa_sinks"
SINK_ATTENTIONS = frozenset({"GptOssAttention"})
SINK_MODEL_TYPES = frozenset({"gpt_oss"})  # models whose every attention module is one of them
_TILE = 8
_BIAS_ALIGN = 16


def _eager_fallback(module: nn.Module) -> Any:
    source = __import__(type(module).__module__, fromlist=["eager_attention_forward"])
    return getattr(source, "eager_attention_forward")  # noqa: B009


def _with_sink_column(mask: torch.Tensor, keys: int) -> torch.Tensor:
    """The mask over the keys and the sink (last): the sink always attends. Its rows are laid out
    16 elements apart (a view of a wider tensor), as the memory-efficient kernel wants its bias."""
    mask = mask[..., :keys]  # transformers may hand a longer (cache-sized) key axis
    width = -(-(keys + 1) // _BIAS_ALIGN) * _BIAS_ALIGN
    fill = True if mask.dtype == torch.bool else 0.0  # the sink column (and the unused tail)
    out = torch.full((*mask.shape[:-1], width), fill, dtype=mask.dtype, device=mask.device)
    out[..., :keys] = mask
    return out[..., : keys + 1]


def _window_mask(queries: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The module's own mask as a boolean (``dtype`` bool) or additive tensor [queries, queries]:
    causal, and within ``window`` tokens (the query's own included) on a sliding layer."""
    index = torch.arange(queries, device=device)
    distance = index[:, None] - index[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    if dtype == torch.bool:
        return allowed
    return torch.zeros(queries, queries, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


# Whether this torch's flash attention op takes a sliding window (read once: dynamo cannot trace it).
_FLASH_WINDOWS = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


@torch.compiler.assume_constant_result
def _flash_device(index: int) -> bool:
    """Whether CUDA device ``index`` runs flash attention (Ampere on)."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def _flash_fits(query: torch.Tensor) -> bool:
    """Whether `_flash_forward` runs ``query`` [batch, n, heads, d]: torch's CPU flash kernel takes
    any float; CUDA's flash attention half precision, head dimensions up to 256 in 8s, Ampere on."""
    if query.device.type == "cpu":
        return query.dtype.is_floating_point
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and _FLASH_WINDOWS
        and _flash_device(
            query.device.index if query.device.index is not None else torch.cuda.current_device()
        )
    )


def _cuda_window(window: int | None) -> dict[str, int | None]:
    """Flash attention's window arguments: the query and ``window - 1`` keys before it."""
    if window is None:
        return {"window_size_left": None, "window_size_right": None}
    return {"window_size_left": window - 1, "window_size_right": 0}


def _cpu_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> tuple[list[torch.Tensor], bool, torch.Tensor | None]:
    """``q``, ``k``, ``v`` head-major ([batch, heads, n, d], each key/value head repeated for its
    group) for torch's CPU flash kernel, and its causal flag or, on a sliding layer, its mask."""
    groups = q.shape[2] // k.shape[2]
    heads = [q.transpose(1, 2), *(t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))]
    mask = None if window is None else _window_mask(q.shape[1], window, q.dtype, q.device)
    return heads, window is None, mask


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Causal (and windowed) attention without sinks: output [batch, n, heads, d], log-sum-exp
    [batch, heads, n] in fp32, and what the backward needs besides. ``q`` [batch, n, heads, d],
    ``k``/``v`` [batch, n, kv_heads, d]."""
    n = q.shape[1]
    if q.is_cuda:
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, n, n, 0.0, True, False, scale=scale, **_cuda_window(window)
        )
        return out, lse, (rng, unused)
    heads, causal, mask = _cpu_inputs(q, k, v, window)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *heads, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2), lse, ()


def _flash_backward(
    grad: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `_flash_forward`'s ``q``, ``k``, ``v`` for the output gradient ``grad``,
    from ``saved`` = (q, k, v, out, lse, *its extra state)."""
    q, k, v, out, lse, *state = saved
    n = q.shape[1]
    if q.is_cuda:
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, None, None, n, n, 0.0, True, *state,
            scale=scale, **_cuda_window(window),
        )  # fmt: skip
        return dq, dk, dv
    batch, _, kv_heads, dim = k.shape
    heads, causal, mask = _cpu_inputs(q, k, v, window)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.transpose(1, 2).contiguous(),
        *heads,
        out.transpose(1, 2).contiguous(),
        lse,
        0.0,
        causal,
        attn_mask=mask,
        scale=scale,
    )

    def summed(d: torch.Tensor) -> torch.Tensor:  # a key/value head's share, summed over its group
        return d.view(batch, kv_heads, -1, n, dim).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), summed(dk), summed(dv)


class _FlashWithSinks(torch.autograd.Function):
    """``o * sigmoid(lse - sink)`` over flash attention, and its exact backward (module
    docstring). ``q`` [batch, n, heads, d], ``k``/``v`` [batch, n, kv_heads, d], ``sinks`` [heads];
    returns [batch, n, heads, d]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        out, lse, state = _flash_forward(q, k, v, scale, window)
        wide = torch.promote_types(q.dtype, torch.float32)  # the weights' and row sums' precision
        weight = torch.sigmoid(lse.to(wide) - sinks.to(wide)[None, :, None]).transpose(1, 2)  # [b, n, heads]
        out = (out.to(wide) * weight[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, weight, *state)
        ctx.scale, ctx.window, ctx.sink_dtype = scale, window, sinks.dtype
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse, weight, *state = ctx.saved_tensors
        scaled = (grad.to(weight.dtype) * weight[..., None]).to(grad.dtype)
        dq, dk, dv = _flash_backward(scaled, (q, k, v, out, lse, *state), ctx.scale, ctx.window)
        through_lse = (grad.to(weight.dtype) * out.to(weight.dtype)).sum(-1) * (1.0 - weight)  # [b, n, heads]
        dsinks = -through_lse.sum((0, 1)).to(ctx.sink_dtype)
        return dq, dk, dv, dsinks, None, None


def sdpa_with_sinks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [batch, heads, n, d], ``key`` and
    ``value`` [batch, kv_heads, n, d]; returns [batch, n, heads, d] as the eager function does (no
    attention weights: they are never materialised)."""
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    window = getattr(module, "sliding_window", None)
    if attention_mask is None and not dropout and sinks is not None and _flash_fits(query.transpose(1, 2)):
        out = _FlashWithSinks.apply(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), sinks, scaling, window
        )
        return out, None
    if attention_mask is None:  # the module's own mask, made explicit for the paths below
        attention_mask = _window_mask(query.shape[2], window, query.dtype, query.device)[None, None]
    if dropout or sinks is None:
        return _eager_fallback(module)(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    batch, heads, _, dim = query.shape
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    padded = -(-(dim + 1) // _TILE) * _TILE
    widen = (0, padded - dim)  # zero head dimensions; the first of them carries the sink
    q = F.pad(query, widen)
    q[..., dim] = 1.0
    sink_key = key.new_zeros(batch, heads, 1, padded)
    sink_key[..., dim] = (sinks.to(key.dtype) / scaling).view(1, heads, 1)
    k = torch.cat([F.pad(key, widen), sink_key], dim=2)
    v = F.pad(value, (*widen, 0, 1))  # and the sink's value: a row of zeros
    mask = _with_sink_column(attention_mask, key.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)[..., :dim]
    return out.transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:  # a transformers without pluggable attention: eager stays
        return False
    AttentionInterface.register(ATTENTION_NAME, sdpa_with_sinks)
    return True


def sink_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is a known sink attention module of a model that chose eager attention."""
    known = any(
        cls.__module__.startswith("transformers.") and cls.__name__ in SINK_ATTENTIONS
        for cls in type(module).__mro__
    )
    config = getattr(module, "config", None)
    return (
        known
        and isinstance(getattr(module, "sinks", None), torch.Tensor)
        and config is not None
        and getattr(config, "_attn_implementation", None) in (None, "eager")
    )


def masks_implicit(config: Any) -> bool:
    """Whether roundpipe's copies of the decoder layers of a model with ``config`` run
    `sdpa_with_sinks` in every attention layer (a known sink model that chose eager attention),
    which reads no mask as the module's own causal or sliding-window mask: the embed layer's copy
    then builds no mask for rows neither padded nor packed."""
    return (
        getattr(config, "model_type", None) in SINK_MODEL_TYPES
        and getattr(config, "_attn_implementation", None) in (None, "eager")
        and _register()
    )


def use_sink_attention(layer: nn.Module) -> int:
    """Make the sink attention modules inside ``layer`` (roundpipe's copy) run `sdpa_with_sinks`;
    how many now do."""
    modules = [m for m in layer.modules() if sink_attention_module(m)]
    if not modules or not _register():
        return 0
    for module in modules:
        config: Any = copy.copy(getattr(module, "config"))  # noqa: B009
        config._attn_implementation = ATTENTION_NAME
        setattr(module, "config", config)  # noqa: B010
    return len(modules)
