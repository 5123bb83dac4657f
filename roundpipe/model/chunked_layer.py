"""A whole attention decoder layer over a long sequence: everything per token, a slice at a time.

Why: at long sequences everything a decoder layer computes per token grows with the sequence, and
autograd keeps most of it. At 262,144 tokens on a Llama-3.1-8B layer (hidden 4096) the norms' fp32
upcasts, the LoRA sums of q/k/v/o, the rotary products and the residuals each make 2-4 GiB
tensors; a decoder block saves about 55 bytes per hidden element for its backward (measured on a
Qwen3 block, docs/memory.md), which here is 55 GiB, and its peak is larger still. Only
attention mixes tokens; all the rest (norms, q/k/v/o projections with their adapters, q/k norms,
rotary, residuals, the MLP) is per token. So the layer runs as three parts: (A) per slice of
`CHUNK_TOKENS` tokens under activation checkpointing, the input norm, q/k/v and rotary; (B) the
attention core, sdpa with the causal flag (flash: no n x n tensor), one call per KV head group
(`_attention`); (C) per slice under checkpointing, o_proj, the residual, the second norm, the
MLP and its residual. What stays for the backward is q, k, v and the attention output (sdpa's
own saved tensors; the input is the caller's): 2.56 hidden-sized tensors per token with 4 query
heads per KV head, measured on the CPU (`tests/test_chunked_layer.py`,
`bench/long_context_memory.py`), and the forward and backward peaks grow by a fixed number of
hidden-sized tensors per token above one slice's working set, which does not grow with the
sequence. The price is parts A and C once more in the backward (per-token matrix products;
attention, the expensive part at these lengths, is not recomputed), paid only above `MIN_TOKENS`
tokens per row.

How: `chunk_long_attention_layer(layer)` swaps the layer's class for a subclass (same parameters,
names and state dict) when the layer has the standard layout (``input_layernorm``, ``self_attn``
with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and optional ``q_norm``/``k_norm``,
``post_attention_layernorm``, ``mlp``: Llama, Qwen2/3, Mistral), so, like `chunked_mlp`, it is
applied to roundpipe's own copies of a layer, never to the user's model. Calls with an attention
mask, a sliding window, attention sinks, dropout or a cache run the original forward. It must never
change what the layer computes: the result equals the original's up to the matrix products'
blocking.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.model.chunked_mlp import _slots, slicing_on
from roundpipe.model.frozen_tail import reading_outputs
from roundpipe.model.swap_class import subclass_of

CHUNK_TOKENS = 16384
MIN_TOKENS = 2 * CHUNK_TOKENS
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_subclasses: dict[type, type] = {}


def chunkable(layer: nn.Module) -> bool:
    """Whether ``layer`` has the layout this module reproduces (checked once, on the module)."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(isinstance(getattr(attn, n, None), nn.Module) for n in _PROJECTIONS):
        return False
    if not all(
        isinstance(getattr(layer, n, None), nn.Module)
        for n in ("input_layernorm", "post_attention_layernorm", "mlp")
    ):
        return False
    config = getattr(attn, "config", None)
    rotary = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    return (
        config is not None
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and getattr(attn, "sliding_window", None) is None
        and getattr(attn, "sinks", None) is None
        and isinstance(getattr(attn, "head_dim", None), int)
        and callable(rotary)
    )


def chunk_long_attention_layer(layer: nn.Module) -> bool:
    """Make ``layer`` run long causal sequences a slice at a time; False when it cannot."""
    base = type(layer)
    if getattr(base, "_roundpipe_sliced", None) == "layers":
        return True
    if not chunkable(layer):
        return False
    layer.__class__ = subclass_of(_subclasses, base, "SequenceChunked", _methods)
    return True


def _methods(base: type) -> dict[str, Any]:
    original: Any = getattr(base, "forward")  # noqa: B009 (a module class; mypy sees a plain type)

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        rotary = kwargs.get("position_embeddings")
        extra = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_embeddings")}
        attn: Any = getattr(self, "self_attn")  # noqa: B009
        plain = (
            args
            or any(v is not None and v is not False for v in extra.values())
            or mask is not None
            or rotary is None
            or hidden_states.dim() != 3
            or hidden_states.shape[1] < MIN_TOKENS
            or not slicing_on(self)
            or (self.training and float(getattr(attn, "attention_dropout", 0.0) or 0.0) > 0)
        )
        if plain or rotary is None:
            return original(self, hidden_states, *args, **kwargs)
        return sliced(self, hidden_states, *rotary)

    @torch.compiler.disable  # Python state (slot rebinding) a captured graph must not bake in
    @reading_outputs  # its slices are recomputed in the backward, where no tail skips
    def sliced(self: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn: Any = getattr(self, "self_attn")  # noqa: B009
        apply_rotary = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")  # noqa: B009
        head_dim = attn.head_dim

        def part_a(xc: torch.Tensor, cc: torch.Tensor, sc: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = getattr(self, "input_layernorm")(xc)  # noqa: B009
            shape = (*h.shape[:-1], -1, head_dim)
            q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
            if isinstance(getattr(attn, "q_norm", None), nn.Module):
                q, k = attn.q_norm(q), attn.k_norm(k)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cc, sc)
            return q, k, v

        def part_c(xc: torch.Tensor, *pieces: torch.Tensor) -> torch.Tensor:
            oc = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]  # every head's slice
            a = attn.o_proj(oc.transpose(1, 2).reshape(*xc.shape[:-1], -1))
            h = xc + a
            return h + getattr(self, "mlp")(getattr(self, "post_attention_layernorm")(h))  # noqa: B009

        step = CHUNK_TOKENS
        xs = x.split(step, dim=1)  # one node: the slices' gradients meet once, not per slice
        cs, ss = cos.split(step, dim=-2), sin.split(step, dim=-2)
        run = _checkpointed(self)
        parts = [run(part_a, xc, cc, sc) for xc, cc, sc in zip(xs, cs, ss, strict=True)]
        q, k, v = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
        del parts
        outs = _attention(q, k, v, attn.scaling)
        del q, k, v
        pieces = [o.split(step, dim=2) for o in outs]
        ys = [run(part_c, xc, *(p[i] for p in pieces)) for i, xc in enumerate(xs)]
        return torch.cat(ys, dim=1)

    # Its kind of slicing (`chunked_mlp.LongRowSlicing`), which also marks it swapped already.
    return {"forward": forward, "_roundpipe_sliced": "layers", "__module__": base.__module__}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """Causal attention, one sdpa call per KV head and the query heads that share it. One call
    over all heads with grouped KV makes the CUDA flash backward expand the key and value
    gradients to every query head and accumulate the query gradient in fp32: at 262,144 tokens of
    an 8B layer, 8 GiB of transients, where one group's call needs an eighth of that. Returns each
    group's output ([batch, heads of the group, tokens, head_dim]), never concatenated: sdpa saves
    them for its backward, and a copy would be kept beside them."""
    group = q.shape[1] // k.shape[1]
    return [
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=group > 1)
        for qg, kg, vg in zip(q.split(group, dim=1), k.split(1, dim=1), v.split(1, dim=1), strict=True)
    ]


def _checkpointed(module: nn.Module) -> Any:
    """Call ``fn(*inputs)`` under non-reentrant checkpointing, with ``module``'s parameter slots
    bound for the recompute as they were for the forward: roundpipe's replicas put placeholders
    back into the slots after a call, and the recompute runs later, in the backward."""
    slots = _slots(module)
    if not torch.is_grad_enabled():
        return lambda fn, *inputs: fn(*inputs)
    bound = [table[leaf] for table, leaf in slots]

    def call(fn: Any, *inputs: torch.Tensor) -> Any:
        def rebound(*args: torch.Tensor) -> Any:
            n = len(inputs)
            current = [table[leaf] for table, leaf in slots]
            for (table, leaf), param in zip(slots, args[n:], strict=True):
                table[leaf] = param
            try:
                return fn(*args[:n])
            finally:
                for (table, leaf), param in zip(slots, current, strict=True):
                    table[leaf] = param

        return checkpoint(rebound, *inputs, *bound, use_reentrant=False)

    return call
