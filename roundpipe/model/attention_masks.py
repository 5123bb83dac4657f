"""The attention masks and rotary tables a causal LM's ``embed`` layer makes once per microbatch.

Why apart from the layer classes: which mask (full or sliding window) and which rotary table each
decoder layer uses is decided per model family (Qwen2/3 and GPT-OSS ``layer_types``, Mistral and
Phi-3 ``sliding_window``, Gemma 3 one rotary table per layer type), and the masks come from
transformers' own builders, whose signatures changed across versions. Keeping that here leaves
``transformers_presets`` with the layers themselves.

Masks are carried under ``"_mask"`` (full attention) and ``"_mask_sliding"`` (sliding window);
rotary tables under ``"_cos"``/``"_sin"`` and, for a model with one table per layer type,
``"_cos_sliding"``/``"_sin_sliding"`` for the sliding layers. This module must never hold model
state: it only reads the config and calls transformers' functions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MASK_KEYS = {FULL_ATTENTION: "_mask", SLIDING_ATTENTION: "_mask_sliding"}
ROTARY_KEYS = {FULL_ATTENTION: ("_cos", "_sin"), SLIDING_ATTENTION: ("_cos_sliding", "_sin_sliding")}


def layer_attention_types(config: Any) -> list[str]:
    """Per decoder layer, which mask it uses, mirroring each model's own forward."""
    n = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2 / Qwen3 / GPT-OSS / Gemma 3: per-layer full or sliding attention
        types = [str(t) for t in layer_types[:n]]
    elif getattr(config, "sliding_window", None) is not None:  # Mistral, Phi-3: all layers slide
        types = [SLIDING_ATTENTION] * n
    else:  # Llama
        types = [FULL_ATTENTION] * n
    unknown = sorted(set(types) - set(MASK_KEYS))
    if unknown:
        raise ModelError(
            f"config.layer_types contains {unknown}; roundpipe supports only {sorted(MASK_KEYS)} layers"
        )
    return types


def rotary_per_layer_type(rotary_emb: nn.Module) -> bool:
    """Whether the model keeps one rotary table per layer type (Gemma 3: ``forward(x, position_ids,
    layer_type)``) rather than one for all layers."""
    return "layer_type" in _parameters(type(rotary_emb).forward)


def rotary_tables(
    rotary_emb: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, types: list[str]
) -> dict[str, torch.Tensor]:
    """The rotary tables the layers of ``types`` read, under their carried keys; contiguous, as
    every copy of them that crosses the link arrives (a table some transformers versions make as a
    transposed view would otherwise reach a compiled layer in two layouts, each compiled apart)."""
    if not rotary_per_layer_type(rotary_emb):
        cos, sin = rotary_emb(hidden, position_ids)
        return {"_cos": cos.contiguous(), "_sin": sin.contiguous()}
    out: dict[str, torch.Tensor] = {}
    for kind in types:
        cos, sin = rotary_emb(hidden, position_ids, kind)
        out[ROTARY_KEYS[kind][0]], out[ROTARY_KEYS[kind][1]] = cos.contiguous(), sin.contiguous()
    return out


def transformers_masks(
    config: Any,
    types: list[str],
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The 4-D masks of ``types`` as transformers builds them (absent where sdpa needs none)."""
    makers = mask_makers()
    masks: dict[str, torch.Tensor] = {}
    for kind in types:
        maker = makers[kind]
        mask = maker(**_mask_kwargs(maker, config, hidden, attention_mask, position_ids))
        if mask is None:  # sdpa applies the causal mask itself (is_causal=True)
            continue
        if not isinstance(mask, torch.Tensor):
            raise ModelError(
                f"transformers built a {type(mask).__name__} attention mask; roundpipe carries only tensors. "
                "Use attn_implementation='sdpa' or 'eager'"
            )
        masks[MASK_KEYS[kind]] = mask
    return masks


def block_masks(
    config: Any,
    types: list[str],
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """4-D masks for packed rows: causal within each example, nothing across examples (and
    the sliding window where a layer has one). Built here, not by transformers, because its
    mask builders detect packing from position_ids only in some versions; a 4-D mask is what
    sdpa (boolean, True = attend) and eager (additive: 0 or the dtype's minimum) take."""
    seq_len = hidden.shape[1]
    index = torch.arange(seq_len, device=hidden.device)
    distance = index[:, None] - index[None, :]  # query - key
    allowed = (packed[:, :, None] == packed[:, None, :]) & (distance >= 0)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    eager = (getattr(config, "_attn_implementation", None) or "eager") == "eager"
    masks: dict[str, torch.Tensor] = {}
    for kind in types:
        mask = allowed
        window = getattr(config, "sliding_window", None)
        if kind == SLIDING_ATTENTION and window is not None:
            mask = mask & (distance < int(window))
        mask = mask[:, None]
        if eager:
            mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
                ~mask, torch.finfo(hidden.dtype).min
            )
        masks[MASK_KEYS[kind]] = mask
    return masks


def packed_sequence_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Per token, which example of its row it belongs to, when rows are packed (positions restart
    at some token: a position that is not the previous one + 1 starts an example); else None."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.long().cumsum(-1)


def mask_makers() -> dict[str, Callable[..., Any]]:
    try:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    except ImportError as exc:  # transformers < 4.53 builds masks inside each model
        raise ModelError(
            "this transformers version has no transformers.masking_utils; roundpipe's causal-LM preset "
            "needs transformers >= 4.53 (pip install -U transformers)"
        ) from exc
    return {FULL_ATTENTION: create_causal_mask, SLIDING_ATTENTION: create_sliding_window_causal_mask}


@functools.cache
def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _mask_kwargs(
    maker: Callable[..., Any],
    config: Any,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
) -> dict[str, Any]:
    """Arguments for transformers' mask builders, whose parameter names changed across versions."""
    names = _parameters(maker)
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
    for cache_name in ("cache", "past_key_values"):  # renamed past_key_values -> cache in 5.2x
        if cache_name in names:
            kwargs[cache_name] = None
            break
    if "cache_position" in names:  # 4.5x
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    if "position_ids" in names:
        kwargs["position_ids"] = position_ids
    return kwargs
