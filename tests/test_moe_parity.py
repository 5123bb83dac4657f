"""Mixture-of-experts causal LMs (Qwen3-MoE, GPT-OSS) through RoundPipe equal the plain transformers loop.

GPT-OSS brings attention sinks, alternating sliding-window / full layers and biased experts; with
``output_router_logits=True`` both models add the router's load-balancing loss, which roundpipe
computes from per-layer sums carried to the head (`roundpipe.model.moe`). That loss is defined per
forward call, so the reference for it is the plain loop at the same microbatches (gradient
accumulation: ``(model(**mb).loss / M).backward()`` per microbatch), which is what roundpipe's
mean of microbatch losses promises. fp32, sync, SGD: losses and weights agree to 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.errors import ModelError
from tests.test_transformers_parity import (
    VOCAB,
    assert_same_weights,
    peft_lora,
    pipe_loop,
    reference_loop,
    sgd,
    tiny_qwen3_moe,
    token_data,
)

MICROBATCHES = 2


def tiny_gpt_oss(seed: int = 0, router_logits: bool = False, layers: int = 4) -> nn.Module:
    """GPT-OSS: sinks, sliding (window 4) and full layers alternating, 2 of 4 biased experts a token."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 2,
        "rope_theta": 150000.0,
    }
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,
        rope_parameters=rope,
        output_router_logits=router_logits,
        router_aux_loss_coef=0.5,  # large, so a wrong auxiliary loss cannot hide under 1e-5
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # no sdpa with sinks


def padded_data(steps: int, batch: int = 4, seq: int = 16, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Rows with right padding (attention_mask 0, labels -100): the mask enters the router loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for row, pad in enumerate((0, 3, 5, 1)):
            mask[row, seq - pad :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def accumulation_loop(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> list[float]:
    """The plain transformers loop at roundpipe's microbatches: mean of the microbatch losses."""
    opt = sgd([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in data:
        total = 0.0
        for i in range(MICROBATCHES):
            part = {k: v.chunk(MICROBATCHES)[i] for k, v in batch.items()}
            loss = model(**part).loss / MICROBATCHES
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_gpt_oss_matches_transformers_loop() -> None:
    model: Any = tiny_gpt_oss()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    data = token_data(3)
    expected = reference_loop(reference, data)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    assert all(not torch.equal(t, initial[n]) for n, t in model.state_dict().items())  # sinks, router too


def test_gpt_oss_layers_use_their_own_mask_kind() -> None:
    """Swap the sliding and full masks and the loss changes: each block reads the mask of its type."""
    from roundpipe.model.transformers_presets import causal_lm_layers

    model: Any = tiny_gpt_oss(layers=2)
    layers, _ = causal_lm_layers(model)
    assert [layer.mask_key for layer in layers[1:-1]] == ["_mask_sliding", "_mask"]
    batch = token_data(1)[0]
    with torch.no_grad():
        x = layers[0](batch)
        assert not torch.equal(x["_mask"], x["_mask_sliding"])
        swapped = dict(x, _mask=x["_mask_sliding"], _mask_sliding=x["_mask"])
        loss, wrong = x, swapped
        for layer in layers[1:]:
            loss, wrong = layer(loss), layer(wrong)
        assert float(loss) == pytest.approx(float(model(**batch).loss), abs=1e-6)
        assert abs(float(wrong) - float(loss)) > 1e-4


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize("make", [tiny_qwen3_moe, tiny_gpt_oss], ids=["qwen3-moe", "gpt-oss"])
def test_router_aux_loss_matches_transformers_loop(make: Any, padded: bool) -> None:
    model: Any = make(router_logits=True)
    reference = copy.deepcopy(model)
    data = padded_data(3) if padded else token_data(3)
    expected = accumulation_loop(reference, data)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)


def test_router_aux_loss_is_in_the_loss() -> None:
    """The layer sequence's loss is transformers' loss with the auxiliary term, not without it."""
    from roundpipe.model.transformers_presets import causal_lm_layers

    model: Any = tiny_qwen3_moe(router_logits=True)
    model.router_aux_loss_coef = 10.0
    layers, _ = causal_lm_layers(model)
    batch = padded_data(1)[0]
    with torch.no_grad():
        x: Any = batch
        for layer in layers:
            x = layer(x)
        out = model(**batch)
    assert float(x) == pytest.approx(float(out.loss), abs=1e-5)
    assert float(out.aux_loss) > 0.1  # the term is there, and large


def test_router_aux_without_router_modules_is_refused() -> None:
    model: Any = tiny_qwen3_moe(router_logits=True)
    del model.num_experts
    with pytest.raises(ModelError, match="output_router_logits=True but roundpipe cannot find its router"):
        roundpipe.RoundPipe(model, config=roundpipe.RunConfig(devices="cpu:1"))


def expert_lora(model: nn.Module) -> nn.Module:
    """LoRA on q/v and on the experts' 3-D weights (peft ``target_parameters``: peft wraps them
    with a parametrization for each forward, as the experts are no ``nn.Linear``)."""
    from peft import LoraConfig

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    return peft_lora(model, config)


@pytest.mark.parametrize("make", [tiny_qwen3_moe, tiny_gpt_oss], ids=["qwen3-moe", "gpt-oss"])
def test_lora_on_experts_matches_peft_loop(make: Any) -> None:
    model = expert_lora(make())
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in adapters) and all("lora_" in n for n in adapters)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    reference = copy.deepcopy(model)
    data = token_data(2)
    expected = reference_loop(reference, data)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), f"frozen {name} changed"


@pytest.mark.parametrize("make", [tiny_qwen3_moe, tiny_gpt_oss], ids=["qwen3-moe", "gpt-oss"])
def test_lora_on_experts_matches_peft_loop_while_another_thread_caches(make: Any) -> None:
    """peft computes expert-LoRA weights under `torch.nn.utils.parametrize.cached()`, whose cache
    is one dict for the process, emptied only when the last thread inside a ``cached()`` leaves.
    With another lane inside one, a replica's entry outlived its call and the next call read
    the old weight and its graph: wrong gradients, or a backward through a freed graph (one
    parity run in ten on a busy CPU). Holding ``cached()`` open here for the whole run stands in
    for that other lane, every time: the results must not change (`Binder.forget_cached`)."""
    from torch.nn.utils import parametrize

    model = expert_lora(make())
    reference = copy.deepcopy(model)
    data = token_data(2)
    expected = reference_loop(reference, data)
    with parametrize.cached():
        losses = pipe_loop(model, data)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
