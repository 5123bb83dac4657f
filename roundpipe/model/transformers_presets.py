"""Layer sequences for transformers decoder-only causal LMs (Qwen3, Qwen2, Llama, Mistral, Gemma 3,
Phi-3, and the mixtures of experts Qwen3-MoE and GPT-OSS).

roundpipe runs a model as a list of layers, each called with one positional argument. A transformers
``*ForCausalLM`` is one big module whose ``forward`` computes the rotary tables and attention masks
once and then loops over its decoder blocks; this module cuts it into ``embed``, ``block.i`` and
``head`` layers that call the model's *own* submodules (no copies of any parameter; tied embeddings
stay one ``nn.Parameter`` shared by ``embed`` and ``head``), so training the layers trains the user's
model and peft's LoRA layers inside the blocks keep working.

Activation convention (shared with the engine): every layer after ``embed`` receives and returns a
dict. ``"hidden"`` is the differentiable hidden state. Keys starting with ``"_"`` are constants made
once per microbatch by ``embed`` and carried unchanged: ``"_cos"``/``"_sin"`` (rotary tables; Gemma 3
adds ``"_cos_sliding"``/``"_sin_sliding"``), ``"_mask"``/``"_mask_sliding"`` (4-D attention masks,
only present when attention needs one: with ``sdpa`` and no padding the causal mask is implicit;
packed rows, told by ``position_ids`` that restart inside a row, get a block-diagonal causal mask;
built in `attention_masks`) and ``"_labels"`` (labels shifted for next-token prediction, -100 =
ignored). The engine never differentiates them. A mixture of experts with its router auxiliary
loss on also carries per-layer router sums, which each MoE block adds to (`moe`). ``head`` returns
the scalar mean loss, computed in chunks of tokens so that the full logits never exist.

This module must never copy weights, change the user's config, or depend on anything in the
pipeline engine; it only knows how to call transformers' modules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model import attention_residual
from roundpipe.model.attention_masks import (
    MASK_KEYS,
    ROTARY_KEYS,
    block_masks,
    layer_attention_types,
    mask_makers,
    packed_sequence_ids,
    rotary_per_layer_type,
    rotary_tables,
    transformers_masks,
)
from roundpipe.model.attention_residual import ResidualSlot
from roundpipe.model.chunked_layer import chunk_long_attention_layer
from roundpipe.model.chunked_mlp import chunk_long_sequences
from roundpipe.model.experts import use_grouped_experts
from roundpipe.model.frozen_tail import mark_tail, tails, unread_tail
from roundpipe.model.loss import (
    DEFAULT_CHUNK_TOKENS,
    chunked_cross_entropy,
    chunked_module_cross_entropy,
    softmax_cross_entropy_grad,
)
from roundpipe.model.moe import (
    MASK_KEY,
    TUPLE_MLPS,
    RouterAux,
    add_router_statistics,
    captured_router_logits,
    router_aux,
    router_aux_loss,
)
from roundpipe.model.sink_attention import masks_implicit, use_sink_attention

__all__ = ["causal_lm_layers", "packed_sequence_ids", "supported_class_name"]

# Classes whose forward this preset reproduces exactly (checked by the tests against model(..., labels=)).
SUPPORTED_CAUSAL_LM_CLASSES: tuple[str, ...] = (
    "Qwen3ForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",  # experts inside each decoder block; router aux loss: roundpipe.model.moe
    "GptOssForCausalLM",  # the same, plus attention sinks (inside its attention module)
    "Gemma3ForCausalLM",  # text-only; one rotary table per layer type (attention_masks.rotary_tables)
    "Phi3ForCausalLM",  # Phi-3 and Phi-4 (mini) text models
)
SUPPORTED_ATTENTION = ("sdpa", "eager")
INPUT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
IGNORE_INDEX = -100


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


class CausalLMEmbed(nn.Module):
    """Layer ``embed``: token embedding + rotary tables + attention masks + shifted labels."""

    def __init__(
        self,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module,
        config: Any,
        mask_types: list[str],
        router_mask: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config  # the model's own config object (read only)
        self.mask_types = sorted(set(mask_types))
        self.router_mask = router_mask  # carry the padding mask for the router aux loss
        self.implicit_masks = False  # rows without padding or packing carry no mask (copies only)

    def roundpipe_replica(self) -> None:
        """On roundpipe's copies only: for a model whose copied attention layers take a missing
        mask as their own causal or sliding one (`sink_attention.masks_implicit`), build none for
        rows without padding or packing, so they run fused kernels that skip the masked blocks."""
        self.implicit_masks = masks_implicit(self.config)

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

        out: dict[str, torch.Tensor] = {"hidden": hidden}
        out.update(rotary_tables(self.rotary_emb, hidden, position_ids, self.mask_types))
        packed = packed_sequence_ids(position_ids) if "position_ids" in inputs else None
        if packed is None:
            if not (self.implicit_masks and attention_mask is None):
                out.update(
                    transformers_masks(self.config, self.mask_types, hidden, attention_mask, position_ids)
                )
        else:
            out.update(block_masks(self.config, self.mask_types, hidden, attention_mask, packed))
        if self.router_mask and attention_mask is not None:
            out[MASK_KEY] = attention_mask.reshape(-1).to(torch.float32)

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


class CausalLMBlock(nn.Module):
    """Layer ``block.i``: one original decoder layer; replaces ``"hidden"``, carries the constants
    (and, for a model with a router auxiliary loss, adds this layer's router sums: `moe`)."""

    def __init__(
        self,
        layer: nn.Module,
        mask_key: str,
        rotary_keys: tuple[str, str] = ("_cos", "_sin"),
        router: RouterAux | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.mask_key = mask_key
        self.rotary_keys = rotary_keys
        self.router = router
        self.router_names = router.router_names(layer) if router is not None else []
        self.residual: ResidualSlot | None = None  # set for one call (`roundpipe_residual`)

    def roundpipe_compile(self, compiler: Any) -> None:
        """The original decoder layer, tensors in and out (this wrapper's dicts stay eager). A
        layer whose router logits are caught by a hook per call stays eager too."""
        if not self.router_names:
            compiler.module(self.layer)

    def roundpipe_replica(self) -> None:
        """On roundpipe's copies only: experts run as grouped matrix products (`experts`),
        attention with sinks through torch's fused kernels (`sink_attention`), the MLP runs long
        sequences a slice of tokens at a time (not an MLP that returns a tuple, nor one whose
        router logits are caught), and so does everything per token in a standard attention
        layer (`chunked_layer`); a frozen ``down_proj`` ending the layer, and a frozen ``o_proj``
        given the residual, can be left out of a recompute (`frozen_tail`, `attention_residual`)."""
        use_grouped_experts(self.layer)
        use_sink_attention(self.layer)
        mlp = getattr(self.layer, "mlp", None)
        if isinstance(mlp, nn.Module) and not self.router_names and type(mlp).__name__ not in TUPLE_MLPS:
            chunk_long_sequences(mlp)
        if not self.router_names:  # and the whole layer, where it has the standard attention layout
            chunk_long_attention_layer(self.layer)
        mark_tail(self.layer)
        attention_residual.install(self.layer)

    @contextmanager
    def roundpipe_residual(self, slot: ResidualSlot) -> Iterator[None]:
        """While inside, a call keeps or uses its residual in ``slot`` (`attention_residual`)."""
        self.residual = slot
        try:
            yield
        finally:
            self.residual = None

    def roundpipe_output_unread(self) -> AbstractContextManager[None]:
        """While inside, a call with grad leaves out the layer's frozen tail product, whose value
        the caller will not read (`frozen_tail`; its gradients stay those of the full call)."""
        return unread_tail(tails(self.layer))

    def forward(self, x: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = dict(x)
        if self.router is None or not self.router_names:
            result["hidden"] = self._layer(x)
            return result
        with captured_router_logits(self.layer, self.router_names, self.router.output_index) as logits:
            result["hidden"] = self._layer(x)
        add_router_statistics(result, logits, self.router, x.get(MASK_KEY))
        return result

    def _layer(self, x: Mapping[str, torch.Tensor]) -> torch.Tensor:
        cos, sin = self.rotary_keys
        hidden, mask = x["hidden"], x.get(self.mask_key)
        with attention_residual.kept_or_used(self.layer, hidden, self.residual):
            out = self.layer(hidden, attention_mask=mask, position_embeddings=(x[cos], x[sin]))
        if isinstance(out, tuple):  # transformers < 5 returns (hidden_states, ...)
            out = out[0]
        return out


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
    """Layer ``head``: final norm + LM head + chunked cross-entropy -> scalar mean loss (plus the
    router auxiliary loss for a model that adds one: `moe`)."""

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        chunk_tokens: int | None = None,
        router: RouterAux | None = None,
    ) -> None:
        super().__init__()
        self.router = router
        self.auto_chunk = chunk_tokens is None
        if chunk_tokens is None:
            chunk_tokens = auto_chunk_tokens(getattr(lm_head, "out_features", 0))
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ModelError(f"loss_chunk_tokens must be a positive int, got {chunk_tokens!r}")
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_tokens = chunk_tokens
        self.loss_kernel: Any = None  # the chunk kernel, when compiled (`roundpipe_compile`)

    def roundpipe_replica(self) -> None:
        """On roundpipe's copies only: the final norm runs long sequences a slice at a time (its
        fp32 upcasts of a 262K-token row are 4 GiB each, and autograd kept them)."""
        chunk_long_sequences(self.norm)

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
        loss = self._lm_loss(x["hidden"], labels)
        aux = router_aux_loss(x, self.router) if self.router is not None else None
        if aux is not None:  # as transformers: loss + router_aux_loss_coef * aux_loss
            assert self.router is not None
            loss = loss + self.router.coef * aux.to(loss.device)
        return loss

    def _lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(hidden)
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


def _check_loss_shape(config: Any, class_name: str) -> None:
    """Refuse what the head's chunked loss and the causal masks do not reproduce."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        raise ModelError(
            f"{class_name} has config.final_logit_softcapping={cap}: roundpipe's chunked loss does not apply "
            "logit soft-capping; set model.config.final_logit_softcapping = None to train without it"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelError(
            f"{class_name} has config.use_bidirectional_attention=True; roundpipe trains causal LMs only"
        )


def causal_lm_layers(model: nn.Module, chunk_tokens: int | None = None) -> tuple[list[nn.Module], list[str]]:
    """Cut a supported ``*ForCausalLM`` into ``embed``, ``block.0..n-1`` and ``head`` layers."""
    class_name = type(model).__name__
    config = _require(model, "config", class_name)
    _check_attention(config)
    _check_loss_shape(config, class_name)
    router = router_aux(model)
    mask_makers()  # fail early on a transformers without masking_utils
    embed_tokens = _require(model, "model.embed_tokens", class_name)
    blocks = _require(model, "model.layers", class_name)
    norm = _require(model, "model.norm", class_name)
    rotary = _require(model, "model.rotary_emb", class_name)
    lm_head = _require(model, "lm_head", class_name)
    n = int(config.num_hidden_layers)
    if len(blocks) < n:
        raise ModelError(f"{class_name} has {len(blocks)} decoder layers but config.num_hidden_layers is {n}")
    types = layer_attention_types(config)
    per_type = rotary_per_layer_type(rotary)
    layers: list[nn.Module] = [
        CausalLMEmbed(embed_tokens, rotary, config, types, router_mask=router is not None)
    ]
    names = ["embed"]
    for i in range(n):
        rotary_keys = ROTARY_KEYS[types[i]] if per_type else ROTARY_KEYS["full_attention"]
        layers.append(CausalLMBlock(blocks[i], MASK_KEYS[types[i]], rotary_keys, router))
        names.append(f"block.{i}")
    layers.append(CausalLMHead(norm, lm_head, chunk_tokens, router))
    names.append("head")
    return layers, names
