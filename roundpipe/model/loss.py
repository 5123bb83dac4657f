"""Cross-entropy over a large vocabulary without ever holding the full logits.

The LM head of a modern model projects every token onto a vocabulary of 100k+ entries; the
[tokens x vocab] logits (and their gradient) are often the largest tensors of a whole training step.
This module computes ``mean(cross_entropy(hidden @ weight.T + bias, labels))`` a chunk of tokens at a
time: the forward keeps only one log-sum-exp per token, and the backward recomputes each chunk's
logits, turns them into that chunk's gradient and drops them again. It must never materialise more
than ``chunk_tokens x vocab`` logits at once, in forward or in backward, and it must give the same
value and gradients as ``F.cross_entropy`` on the full logits (logits are upcast to fp32 as
transformers does). It knows nothing of models, pipelines or devices.
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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of (logsumexp(z) - z[label]) / n_valid, z = h @ W.T + b, chunked over tokens."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = F.linear(hidden[start:end], weight, bias).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe_labels[start:end, None]).squeeze(1)
            total = total + torch.where(valid[start:end], chunk_lse - target, 0.0).sum()
            lse[start:end] = chunk_lse
            del logits
        count = valid.sum().clamp(min=1).to(torch.float32)
        ctx.chunk_tokens = chunk_tokens
        ctx.has_bias = bias is not None
        ctx.save_for_backward(
            hidden, weight, bias if bias is not None else torch.empty(0), safe_labels, valid, lse, count
        )
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias_saved, safe_labels, valid, lse, count = ctx.saved_tensors
        bias = bias_saved if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        chunk_tokens: int = ctx.chunk_tokens
        scale = grad_loss.to(torch.float32) / count
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The weight gradient accumulates in the weight's dtype with one rounding per chunk (addmm sums
        # in fp32 internally); an fp32 accumulator would cost vocab x hidden x 4 bytes more device memory.
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            h = hidden[start:end]
            # d loss / d logits = (softmax - onehot(label)) * valid * scale, built in place on the logits
            grad_logits = F.linear(h, weight, bias).float()
            grad_logits.sub_(lse[start:end, None]).exp_()
            grad_logits.scatter_add_(
                1, safe_labels[start:end, None], torch.full((end - start, 1), -1.0, device=h.device)
            )
            grad_logits.mul_((valid[start:end].to(torch.float32) * scale)[:, None])
            if grad_b is not None:
                grad_b += grad_logits.sum(0)
            g = grad_logits.to(weight.dtype)
            del grad_logits
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[start:end])
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
            del g
        return (
            grad_h,
            grad_w,
            grad_b.to(bias_saved.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` over non-ignored tokens.

    ``hidden`` is ``[N, H]``, ``weight`` ``[V, H]``, ``labels`` ``[N]`` (``ignore_index`` marks tokens
    that do not count), ``bias`` ``[V]`` or None. At most ``chunk_tokens x V`` logits exist at any time,
    in forward and in backward (the backward recomputes each chunk's logits). Returns an fp32 scalar.
    When every token is ignored the result is 0 with zero gradients (``F.cross_entropy`` gives NaN).
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
    result: torch.Tensor = _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, labels, chunk_tokens, ignore_index
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
