"""Mixture-of-experts models in the layer sequence: the router's load-balancing (auxiliary) loss.

Why: Qwen3-MoE and GPT-OSS add ``router_aux_loss_coef * aux_loss`` to the language-model loss when
``config.output_router_logits`` is on. transformers computes ``aux_loss``
(``load_balancing_loss_func``) at the end of its forward from every layer's router logits; in a
pipeline those layers run in different stages. The formula needs only three sums over the routed
layers: per expert, the number of top-k assignments ``T`` (optionally weighted by the padding mask;
from ``topk`` indices, so not differentiable), the sum of router probabilities ``P`` (masked the
same way; differentiable) and the number of counted rows ``R``. Then ``aux = E * sum(T/R * P/R)``.
So each MoE block adds its layer's share to three carried entries: ``"router_probs"`` (a floating
key without ``"_"``: the engine sends its gradient back across stage boundaries like
``"hidden"``'s, so each router gets exactly its gradient), ``"_router_counts"`` and
``"_router_rows"`` (constants); the head applies the formula. The numbers are transformers' own,
added layer by layer in the same order.

Per microbatch: roundpipe trains the mean of the microbatch losses, so the auxiliary loss is that
of each microbatch, exactly what transformers computes when that microbatch is its batch (plain
gradient accumulation). It is not the auxiliary loss of the whole batch: that one multiplies two
sums over all tokens, and no microbatch's share of it is known before every microbatch has been
routed through every layer, which a pipeline that starts backward passes early never has.

The router logits are caught by a forward hook on the router modules (the class transformers
itself records, ``_can_record_outputs["router_logits"]``), registered for the duration of one
block call and recording only that thread's calls. This module must never change the routing or
the user's config; it only observes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError

PROBS_KEY = "router_probs"
COUNTS_KEY = "_router_counts"
ROWS_KEY = "_router_rows"
MASK_KEY = "_router_mask"

# MLP classes whose forward returns a tuple (hidden, router scores): never sliced over tokens.
TUPLE_MLPS = frozenset({"GptOssMLP"})


@dataclass(frozen=True)
class RouterAux:
    """What a model's load-balancing loss needs: the router class, E, top-k and the coefficient."""

    router_class: type
    output_index: int
    num_experts: int
    top_k: int
    coef: float

    def router_names(self, layer: nn.Module) -> list[str]:
        """Names (inside ``layer``) of the router modules whose logits this layer produces."""
        return [name for name, module in layer.named_modules() if isinstance(module, self.router_class)]


def router_aux(model: nn.Module) -> RouterAux | None:
    """The load-balancing loss ``model`` adds to its loss, or None when it adds none."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    class_name = type(model).__name__
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    router_class = getattr(recorder, "target_class", None)
    values: list[Any] = [
        getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    ]
    if not isinstance(router_class, type) or any(v is None for v in values):
        raise ModelError(
            f"{class_name} has config.output_router_logits=True but roundpipe cannot find its router "
            "modules and expert counts to compute the router auxiliary loss; set "
            "model.config.output_router_logits = False (the language-model loss alone is then trained)"
        )
    num_experts, top_k, coef = values
    return RouterAux(
        router_class, int(getattr(recorder, "index", 0) or 0), int(num_experts), int(top_k), float(coef)
    )


@contextmanager
def captured_router_logits(layer: nn.Module, names: list[str], index: int) -> Iterator[list[torch.Tensor]]:
    """Router logits of the calls, made by this thread, of ``layer``'s routers ``names`` inside the block."""
    caught: list[torch.Tensor] = []
    thread = threading.get_ident()

    def record(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == thread:
            caught.append(output[index] if isinstance(output, tuple | list) else output)

    handles = [layer.get_submodule(name).register_forward_hook(record) for name in names]
    try:
        yield caught
    finally:
        for handle in handles:
            handle.remove()


def add_router_statistics(
    result: dict[str, torch.Tensor], logits: list[torch.Tensor], spec: RouterAux, mask: torch.Tensor | None
) -> None:
    """Add the sums of ``load_balancing_loss_func`` for these router logits ([rows, E] each) to ``result``."""
    for layer_logits in logits:
        weights = torch.nn.functional.softmax(layer_logits, dim=-1)
        _, selected = torch.topk(weights, spec.top_k, dim=-1)
        flat = selected.reshape(-1)
        if mask is None:
            per_choice = torch.ones(flat.shape, dtype=torch.float32, device=flat.device)
            probs = weights.float().sum(dim=0)
            rows = torch.tensor(float(weights.shape[0]), device=flat.device)
        else:
            mask = mask.to(device=flat.device, dtype=torch.float32)
            per_choice = mask.repeat_interleave(spec.top_k)
            probs = (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = mask.sum()
        counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=flat.device)
        counts = counts.scatter_add_(0, flat, per_choice)
        if PROBS_KEY in result:  # the same order of additions as transformers: layer by layer
            probs = result[PROBS_KEY] + probs
            counts = result[COUNTS_KEY] + counts
            rows = result[ROWS_KEY] + rows
        result[PROBS_KEY], result[COUNTS_KEY], result[ROWS_KEY] = probs, counts, rows


def router_aux_loss(x: Mapping[str, torch.Tensor], spec: RouterAux) -> torch.Tensor | None:
    """``load_balancing_loss_func`` from the carried sums (None when no layer routed)."""
    probs = x.get(PROBS_KEY)
    if probs is None:
        return None
    rows = x[ROWS_KEY]
    tokens_per_expert = x[COUNTS_KEY] / rows
    router_prob_per_expert = probs / rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * spec.num_experts
