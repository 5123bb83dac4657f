"""Cross-entropy over a large vocabulary without ever holding the full logits.

The LM head of a modern model projects every token onto a vocabulary of 100k+ entries; the
[tokens x vocab] logits (and their gradient) are often the largest tensors of a whole training step.
This module computes ``mean(cross_entropy(hidden @ weight.T + bias, labels))`` a chunk of tokens at a
time. A loss is the end of the graph, so when a gradient will be wanted the forward computes it
too, while each chunk's logits are at hand (the backward only scales it by the incoming scalar):
three matrix products per chunk instead of four, and one pass of elementwise work over the logits,
which `torch.compile` can fuse (on a 152K vocabulary that pass, done eagerly in fp32, cost as much
as the matrix products). It must never materialise more than ``chunk_tokens x vocab`` logits (and
their gradient) at once, and it must give the same value and gradients as ``F.cross_entropy`` on
the full logits (logits are upcast to fp32 as transformers does). It knows nothing of models,
pipelines or devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from roundpipe.errors import ModelError

DEFAULT_CHUNK_TOKENS = 1024


def _check_args(hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> None:
    if hidden.dim() != 2:
        raise ModelError(
            f"chunked cross-entropy expects hidden of shape [tokens, hidden_size], got {tuple(hidden.shape)}; "
            "flatten the batch and sequence dimensions first (hidden.reshape(-1, hidden.shape[-1]))"
        )
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ModelError(
            f"chunked cross-entropy expects labels of shape [{hidden.shape[0]}] (one per token of hidden), "
            f"got {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ModelError(f"labels must be an integer tensor of class indices, got dtype {labels.dtype}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ModelError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")


def _check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    # A host sync; only done for CPU tensors (on CUDA an out-of-range index trips a device assert).
    if labels.is_cuda or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ModelError(
            f"label {value} is outside the vocabulary [0, {vocab_size}); use ignore_index={ignore_index} "
            "for positions that must not count in the loss"
        )


def softmax_cross_entropy_grad(
    logits: torch.Tensor, safe_labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's loss and gradient from its logits, in one pass over them.

    Returns ``sum(weights * (logsumexp(z) - z[label]))`` in fp32 and ``weights * (softmax(z) -
    onehot(label))`` in the logits' dtype, with ``z = logits`` upcast to fp32 (as transformers
    does). Written as plain tensor code so that ``torch.compile`` can fuse it into one or two
    kernels; eager it costs several passes over the chunk."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    target = z.gather(1, safe_labels[:, None])
    loss = (weights * (lse - target).squeeze(1)).sum()
    columns = torch.arange(z.shape[1], device=z.device)[None, :]
    probs = torch.exp(z - lse) - (columns == safe_labels[:, None]).to(z.dtype)
    return loss, (probs * weights[:, None]).to(logits.dtype)


ChunkKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of (logsumexp(z) - z[label]) / n_valid, z = h @ W.T + b, chunked over tokens.

    When a gradient will be needed, it is computed in the forward, chunk by chunk, while the
    chunk's logits are at hand: three matrix products per chunk (logits, input gradient, weight
    gradient) instead of four (the backward would compute the logits again), and one pass of
    elementwise work. The backward then only scales what the forward left by the incoming
    gradient. The loss is always the end of the graph (its gradient is a scalar), so the forward
    knows every gradient but that scale."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        grads: tuple[bool, bool, bool],
        kernel: ChunkKernel,
    ) -> torch.Tensor:
        need_h, need_w, need_b = grads
        n = hidden.shape[0]
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        count = valid.sum().clamp(min=1).to(torch.float32)
        weights = valid.to(torch.float32) / count
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The weight gradient accumulates in the weight's dtype with one rounding per chunk (addmm sums
        # in fp32 internally); an fp32 accumulator would cost vocab x hidden x 4 bytes more device memory.
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            h = hidden[start:end]
            logits = F.linear(h, weight, bias)
            chunk_loss, grad_logits = kernel(logits, safe_labels[start:end], weights[start:end])
            del logits
            total = total + chunk_loss
            if grad_b is not None:
                grad_b += grad_logits.sum(0, dtype=torch.float32)
            if grad_h is not None:
                torch.mm(grad_logits, weight, out=grad_h[start:end])
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t(), h)
            del grad_logits
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_h, grad_w, grad_b)),
        )
        ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        has_h, has_w, has_b = ctx.present
        scale = grad_loss.to(torch.float32)
        # In place: these tensors are the forward's own, and nothing else refers to them.
        out_h = grad_h.mul_(scale) if has_h else None
        out_w = grad_w.mul_(scale) if has_w else None
        out_b = grad_b.mul_(scale).to(ctx.bias_dtype) if has_b else None
        return out_h, out_w, out_b, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    *,
    kernel: ChunkKernel | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` over non-ignored tokens.

    ``hidden`` is ``[N, H]``, ``weight`` ``[V, H]``, ``labels`` ``[N]`` (``ignore_index`` marks tokens
    that do not count), ``bias`` ``[V]`` or None. At most ``chunk_tokens x V`` logits (and as many
    gradients of them) exist at any time. Under grad, the gradients of ``hidden``, ``weight`` and
    ``bias`` are computed during this call and kept until the backward (which only scales them), so
    call ``backward`` on the result, or drop it. ``kernel`` replaces `softmax_cross_entropy_grad`
    for each chunk's elementwise work (e.g. that function through ``torch.compile``). Returns an fp32 scalar. When every token is ignored the
    result is 0 with zero gradients (``F.cross_entropy`` gives NaN).
    """
    _check_args(hidden, labels, chunk_tokens)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ModelError(
            f"weight must be [vocab, {hidden.shape[1]}] to match hidden [tokens, {hidden.shape[1]}], "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ModelError(
            f"bias must be [{weight.shape[0]}] (one per vocabulary entry), got {tuple(bias.shape)}"
        )
    _check_label_range(labels, weight.shape[0], ignore_index)
    grad = torch.is_grad_enabled()
    grads = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    result: torch.Tensor = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, labels, chunk_tokens, ignore_index, grads, kernel or softmax_cross_entropy_grad
    )
    return result


def _chunk_ce_sum(
    project: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = project(h).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def chunked_module_cross_entropy(
    hidden: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Like :func:`chunked_cross_entropy` for an arbitrary projection module (e.g. a LoRA-wrapped head).

    Each chunk runs under activation checkpointing, so its logits are freed after the forward and
    recomputed (one chunk at a time) in the backward. Slower than the fused path; used only when the
    head is not a plain ``nn.Linear``.
    """
    _check_args(hidden, labels, chunk_tokens)
    count = (labels != ignore_index).sum().clamp(min=1).to(torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        part = checkpoint(
            _chunk_ce_sum, project, hidden[start:end], labels[start:end], ignore_index, use_reentrant=False
        )
        total = total + part
    return total / count
