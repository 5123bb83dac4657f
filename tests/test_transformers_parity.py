"""transformers models trained through RoundPipe equal the plain transformers / peft training loop.

The reference is the textbook loop on one device: ``model(**batch).loss.backward(); opt.step()``.
RoundPipe runs the same model split into embed / blocks / head on two CPU workers, in
microbatches, with the model's own (chunked) loss: fp32 and sync, losses and weights must agree
to 1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from tests.helpers import tiny_causal_lm

VOCAB = 64


def tiny_qwen3(seed: int = 0) -> nn.Module:
    return tiny_causal_lm("qwen3", vocab=VOCAB, attn="eager", seed=seed)


def tiny_llama(seed: int = 0) -> nn.Module:
    return tiny_causal_lm("llama", vocab=VOCAB, attn="sdpa", seed=seed)


def tiny_qwen3_moe(seed: int = 0, router_logits: bool = False) -> nn.Module:
    """Qwen3-MoE: every decoder block routes each token to 2 of 4 experts."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        output_router_logits=router_logits,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def token_data(steps: int, batch: int = 4, seq: int = 16, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# SGD with momentum, not Adam, for weight comparisons: Adam divides by sqrt(v), so on parameters
# whose gradients are ~0 a 1e-7 difference in summation order (microbatches vs full batch) becomes
# an lr-sized difference in the update, which says nothing about correctness.
def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference_loop(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> list[float]:
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    opt = sgd(params)
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pipe_loop(
    model: nn.Module, data: list[dict[str, torch.Tensor]], meta: dict[str, Any] | None = None, **options: Any
) -> list[float]:
    """The pipe's losses over ``data``, one step a batch (sync, fp32, cpu:2; ``options`` change the
    `RunConfig`); ``meta``, when given, receives the trace's meta."""
    fields: dict[str, Any] = dict(
        devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="fp32"
    )
    config = roundpipe.RunConfig(**(fields | options))
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        losses = []
        for batch in data:
            losses.append(pipe.forward_backward(batch, None, None))
            pipe.step()
        pipe.synchronize()
        if meta is not None:
            meta.update(pipe.trace().meta)
    return losses


def assert_same_weights(actual: nn.Module, expected: nn.Module) -> None:
    got, want = actual.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{name} differs")


@pytest.mark.parametrize(
    "make", [tiny_qwen3, tiny_llama, tiny_qwen3_moe], ids=["qwen3-tied-eager", "llama-sdpa", "qwen3-moe-sdpa"]
)
def test_full_training_matches_transformers_loop(make: Callable[[], nn.Module]) -> None:
    model: Any = make()
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    data = token_data(3)
    expected = reference_loop(reference, data)
    losses = pipe_loop(model, data)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    # It did train: every tensor moved.
    assert all(not torch.equal(t, initial[n]) for n, t in model.state_dict().items())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def lora(model: nn.Module, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> nn.Module:
    from peft import LoraConfig

    return peft_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))


def peft_lora(model: nn.Module, config: Any) -> nn.Module:
    """``model`` wrapped by peft with ``config`` (a ``LoraConfig``), seeded, with every lora_B
    drawn away from peft's zero so the first step moves every adapter tensor."""
    from peft import get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    return peft_model


def test_lora_matches_peft_loop() -> None:
    model = lora(tiny_qwen3())
    reference = copy.deepcopy(model)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    data = token_data(3)
    expected = reference_loop(reference, data)

    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=False)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        in_optimizers = [
            p for opt in pipe.host.optimizers.values() for g in opt.param_groups for p in g["params"]
        ]
        by_id = {id(p): n for n, p in model.named_parameters()}
        # Only adapter tensors, each exactly once (the fp32 module parameters are the optimizer copy).
        assert sorted(by_id[id(p)] for p in in_optimizers) == sorted(adapters)
        losses = []
        for batch in data:
            losses.append(pipe.forward_backward(batch, None, None))
            pipe.step()
        pipe.synchronize()

    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    for name, param in model.named_parameters():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), f"frozen {name} changed"
            assert param.grad is None
