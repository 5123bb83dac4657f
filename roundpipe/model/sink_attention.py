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
_TILE = 8
_BIAS_ALIGN = 16


def _eager_fallback(module: nn.Module) -> Any:
    source = __import__(type(module).__module__, fromlist=["eager_attention_forward"])
    return getattr(source, "eager_attention_forward")  # noqa: B009


def _with_sink_column(
    mask: torch.Tensor | None, queries: int, keys: int, device: torch.device
) -> torch.Tensor:
    """The mask over the keys and the sink (last): the sink always attends. Without a mask, the
    causal one eager attention would get. Its rows are laid out 16 elements apart (a view of a
    wider tensor), as the memory-efficient kernel wants its bias."""
    if mask is None:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril_()[None, None]
    mask = mask[..., :keys]  # transformers may hand a longer (cache-sized) key axis
    width = -(-(keys + 1) // _BIAS_ALIGN) * _BIAS_ALIGN
    fill = True if mask.dtype == torch.bool else 0.0  # the sink column (and the unused tail)
    out = torch.full((*mask.shape[:-1], width), fill, dtype=mask.dtype, device=mask.device)
    out[..., :keys] = mask
    return out[..., : keys + 1]


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
    if dropout or sinks is None:
        return _eager_fallback(module)(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    batch, heads, n, dim = query.shape
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
    mask = _with_sink_column(attention_mask, n, key.shape[2], query.device)
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
