"""Layer sequences for transformers decoder-only causal LMs (Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE).

roundpipe runs a model as a list of layers, each called with one positional argument. A transformers
``*ForCausalLM`` is one big module whose ``forward`` computes the rotary tables and attention masks
once and then loops over its decoder blocks; this module cuts it into ``embed``, ``block.i`` and
``head`` layers that call the model's *own* submodules (no copies of any parameter; tied embeddings
stay one ``nn.Parameter`` shared by ``embed`` and ``head``), so training the layers trains the user's
model and peft's LoRA layers inside the blocks keep working.

Activation convention (shared with the engine): every layer after ``embed`` receives and returns a
dict. ``"hidden"`` is the differentiable hidden state. Keys starting with ``"_"`` are constants made
once per microbatch by ``embed`` and carried unchanged: ``"_cos"``/``"_sin"`` (rotary tables),
``"_mask"``/``"_mask_sliding"`` (4-D attention masks, only present when attention needs one: with
``sdpa`` and no padding the causal mask is implicit; packed rows, told by ``position_ids`` that
restart inside a row, get a block-diagonal causal mask) and ``"_labels"`` (labels shifted for next-token
prediction, -100 = ignored). The engine never differentiates them. ``head`` returns the scalar mean
loss, computed in chunks of tokens so that the full logits never exist.

This module must never copy weights, change the user's config, or depend on anything in the
pipeline engine; it only knows how to call transformers' modules.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model.chunked_mlp import chunk_long_sequences
from roundpipe.model.loss import (
    DEFAULT_CHUNK_TOKENS,
    chunked_cross_entropy,
    chunked_module_cross_entropy,
    softmax_cross_entropy_grad,
)

# Classes whose forward this preset reproduces exactly (checked by the tests against model(..., labels=)).
SUPPORTED_CAUSAL_LM_CLASSES: tuple[str, ...] = (
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",  # experts inside each decoder block; see _check_router_loss
)
SUPPORTED_ATTENTION = ("sdpa", "eager")
INPUT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
IGNORE_INDEX = -100

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MASK_KEYS = {FULL_ATTENTION: "_mask", SLIDING_ATTENTION: "_mask_sliding"}


def supported_class_name(model: nn.Module) -> str | None:
    """The supported class ``model`` is (or derives from), else None. Never imports transformers."""
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED_CAUSAL_LM_CLASSES and cls.__module__.startswith("transformers."):
            return cls.__name__
    return None


def _check_attention(config: Any) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ModelError(
            f"attention implementation {impl!r} is not supported by roundpipe's layer sequence "
            f"(supported: {', '.join(SUPPORTED_ATTENTION)}); load the model with attn_implementation='sdpa' "
            "or call model.set_attn_implementation('sdpa') before passing it"
        )


def layer_attention_types(config: Any) -> list[str]:
    """Per decoder layer, which mask it uses, mirroring each model's own forward."""
    n = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2 / Qwen3: per-layer full or sliding attention
        types = [str(t) for t in layer_types[:n]]
    elif getattr(config, "sliding_window", None) is not None:  # Mistral: all layers slide
        types = [SLIDING_ATTENTION] * n
    else:  # Llama
        types = [FULL_ATTENTION] * n
    unknown = sorted(set(types) - set(MASK_KEYS))
    if unknown:
        raise ModelError(
            f"config.layer_types contains {unknown}; roundpipe supports only {sorted(MASK_KEYS)} layers"
        )
    return types


class CausalLMEmbed(nn.Module):
    """Layer ``embed``: token embedding + rotary tables + attention masks + shifted labels."""

    def __init__(
        self, embed_tokens: nn.Module, rotary_emb: nn.Module, config: Any, mask_types: list[str]
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config  # the model's own config object (read only)
        self.mask_types = sorted(set(mask_types))

    def roundpipe_compile(self, compiler: Any) -> None:
        """Stays eager: input checks and mask building are Python logic, and it is cheap."""

    def forward(self, inputs: Mapping[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
        if isinstance(inputs, torch.Tensor):
            inputs = {"input_ids": inputs}
        if not isinstance(inputs, Mapping):
            raise ModelError(
                f"the embed layer expects a dict with 'input_ids' (and 'labels', optional 'attention_mask'), "
                f"got {type(inputs).__name__}"
            )
        extra = sorted(set(inputs) - set(INPUT_KEYS))
        if extra:
            raise ModelError(
                f"unexpected input keys {extra}; a transformers model takes {list(INPUT_KEYS)} "
                "(drop the others, e.g. token_type_ids, before calling)"
            )
        input_ids = inputs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ModelError("inputs['input_ids'] must be a LongTensor of shape [batch, seq_len]")
        _check_attention(self.config)
        batch, seq_len = input_ids.shape
        hidden = self.embed_tokens(input_ids)

        position_ids = inputs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, seq_len)
        attention_mask = inputs.get("attention_mask")
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq_len):
            raise ModelError(
                f"attention_mask must be a [batch, seq_len] = {[batch, seq_len]} 0/1 padding mask, "
                f"got {list(attention_mask.shape)}"
            )

        cos, sin = self.rotary_emb(hidden, position_ids)
        out: dict[str, torch.Tensor] = {"hidden": hidden, "_cos": cos, "_sin": sin}
        packed = packed_sequence_ids(position_ids) if "position_ids" in inputs else None
        if packed is None:
            out.update(self._masks(hidden, attention_mask, position_ids))
        else:
            out.update(self._block_masks(hidden, attention_mask, packed))

        labels = inputs.get("labels")
        if labels is not None:
            if tuple(labels.shape) != (batch, seq_len):
                raise ModelError(
                    f"labels must have the shape of input_ids {[batch, seq_len]}, got {list(labels.shape)}"
                )
            # Token t predicts token t+1: shift left, the last position has no target.
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            out["_labels"] = shifted
        return out

    def _masks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        makers = _mask_makers()
        masks: dict[str, torch.Tensor] = {}
        for kind in self.mask_types:
            maker = makers[kind]
            mask = maker(**_mask_kwargs(maker, self.config, hidden, attention_mask, position_ids))
            if mask is None:  # sdpa applies the causal mask itself (is_causal=True)
                continue
            if not isinstance(mask, torch.Tensor):
                raise ModelError(
                    f"transformers built a {type(mask).__name__} attention mask; roundpipe carries only tensors. "
                    "Use attn_implementation='sdpa' or 'eager'"
                )
            masks[MASK_KEYS[kind]] = mask
        return masks

    def _block_masks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, packed: torch.Tensor
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
        eager = (getattr(self.config, "_attn_implementation", None) or "eager") == "eager"
        masks: dict[str, torch.Tensor] = {}
        for kind in self.mask_types:
            mask = allowed
            window = getattr(self.config, "sliding_window", None)
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


def _mask_makers() -> dict[str, Callable[..., Any]]:
    try:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    except ImportError as exc:  # transformers < 4.53 builds masks inside each model
        raise ModelError(
            "this transformers version has no transformers.masking_utils; roundpipe's causal-LM preset "
            "needs transformers >= 4.53 (pip install -U transformers)"
        ) from exc
    return {FULL_ATTENTION: create_causal_mask, SLIDING_ATTENTION: create_sliding_window_causal_mask}


@functools.cache
def _mask_parameters(maker: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(maker).parameters)


def _mask_kwargs(
    maker: Callable[..., Any],
    config: Any,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
) -> dict[str, Any]:
    """Arguments for transformers' mask builders, whose parameter names changed across versions."""
    names = _mask_parameters(maker)
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


class CausalLMBlock(nn.Module):
    """Layer ``block.i``: one original decoder layer; replaces ``"hidden"``, carries the constants."""

    def __init__(self, layer: nn.Module, mask_key: str) -> None:
        super().__init__()
        self.layer = layer
        self.mask_key = mask_key

    def roundpipe_compile(self, compiler: Any) -> None:
        """The original decoder layer, tensors in and out (this wrapper's dicts stay eager)."""
        compiler.module(self.layer)

    def roundpipe_replica(self) -> None:
        """On roundpipe's copies only: the MLP runs long sequences a slice of tokens at a time."""
        mlp = getattr(self.layer, "mlp", None)
        if isinstance(mlp, nn.Module):
            chunk_long_sequences(mlp)

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.layer(
            x["hidden"],
            attention_mask=x.get(self.mask_key),
            position_embeddings=(x["_cos"], x["_sin"]),
        )
        if isinstance(out, tuple):  # transformers < 5 returns (hidden_states, ...)
            out = out[0]
        result = dict(x)
        result["hidden"] = out
        return result


def auto_chunk_tokens(vocab_size: int, fused: bool = False) -> int:
    """Tokens per loss chunk when none is given: at most 64M logits at once (128 MiB in bf16, and
    as much again for their gradient, plus the eager kernel's fp32 temporaries), or 128M with the
    fused kernel, which has no temporaries and whose matrix products run faster on longer chunks
    (a 152K vocabulary on an H200: 75 ms per 16K tokens at 384 a chunk, 64 ms at 1024); a multiple
    of 64 tokens (matrix tiles); never more than `DEFAULT_CHUNK_TOKENS`."""
    if vocab_size <= 0:
        return DEFAULT_CHUNK_TOKENS
    logits = 1 << (27 if fused else 26)
    return max(64, min(DEFAULT_CHUNK_TOKENS, logits // vocab_size // 64 * 64))


class CausalLMHead(nn.Module):
    """Layer ``head``: final norm + LM head + chunked cross-entropy -> scalar mean loss."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.auto_chunk = chunk_tokens is None
        if chunk_tokens is None:
            chunk_tokens = auto_chunk_tokens(getattr(lm_head, "out_features", 0))
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ModelError(f"loss_chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_tokens = chunk_tokens
        self.loss_kernel: Any = None  # the chunk kernel, when compiled (`roundpipe_compile`)

    def roundpipe_compile(self, compiler: Any) -> None:
        """The loss's per-chunk elementwise pass, fused (chunk lengths vary: dynamic shapes)."""
        self.loss_kernel = compiler.function(softmax_cross_entropy_grad, dynamic=True)
        if self.auto_chunk:
            self.chunk_tokens = auto_chunk_tokens(getattr(self.lm_head, "out_features", 0), fused=True)

    def forward(self, x: Mapping[str, torch.Tensor]) -> torch.Tensor:
        labels = x.get("_labels")
        if labels is None:
            raise ModelError(
                "labels are required for training: pass inputs={'input_ids': ids, 'labels': ids} "
                "(labels are shifted inside the model; use -100 for positions that must not count)"
            )
        hidden = self.norm(x["hidden"])
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        if type(self.lm_head) is nn.Linear:
            return chunked_cross_entropy(
                flat,
                self.lm_head.weight,
                flat_labels,
                self.chunk_tokens,
                IGNORE_INDEX,
                self.lm_head.bias,
                kernel=self.loss_kernel,
            )
        return chunked_module_cross_entropy(flat, self.lm_head, flat_labels, self.chunk_tokens, IGNORE_INDEX)


def _require(obj: Any, path: str, class_name: str) -> Any:
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ModelError(
                f"{class_name} has no '{path}'; roundpipe expects the standard layout model.model.embed_tokens, "
                "model.model.layers, model.model.norm, model.model.rotary_emb and model.lm_head"
            )
        obj = getattr(obj, part)
    return obj


def _check_router_loss(config: Any, class_name: str) -> None:
    """A mixture-of-experts model that asks for its router's load-balancing loss would get a
    different loss from the layer sequence, which carries no router logits to the head."""
    if getattr(config, "output_router_logits", False):
        raise ModelError(
            f"{class_name} has config.output_router_logits=True: its router auxiliary loss is not computed "
            "by roundpipe's layer sequence yet; set model.config.output_router_logits = False (the "
            "language-model loss alone is then trained, as transformers does by default)"
        )


def causal_lm_layers(model: nn.Module, chunk_tokens: int | None = None) -> tuple[list[nn.Module], list[str]]:
    """Cut a supported ``*ForCausalLM`` into ``embed``, ``block.0..n-1`` and ``head`` layers."""
    class_name = type(model).__name__
    config = _require(model, "config", class_name)
    _check_attention(config)
    _check_router_loss(config, class_name)
    _mask_makers()  # fail early on a transformers without masking_utils
    embed_tokens = _require(model, "model.embed_tokens", class_name)
    blocks = _require(model, "model.layers", class_name)
    norm = _require(model, "model.norm", class_name)
    rotary = _require(model, "model.rotary_emb", class_name)
    lm_head = _require(model, "lm_head", class_name)
    n = int(config.num_hidden_layers)
    if len(blocks) < n:
        raise ModelError(f"{class_name} has {len(blocks)} decoder layers but config.num_hidden_layers is {n}")
    types = layer_attention_types(config)
    layers: list[nn.Module] = [CausalLMEmbed(embed_tokens, rotary, config, types)]
    names = ["embed"]
    for i in range(n):
        layers.append(CausalLMBlock(blocks[i], MASK_KEYS[types[i]]))
        names.append(f"block.{i}")
    layers.append(CausalLMHead(norm, lm_head, chunk_tokens))
    names.append("head")
    return layers, names
