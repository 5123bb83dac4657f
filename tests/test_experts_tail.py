"""A recompute that leaves out a mixture-of-experts layer's output (`roundpipe.model.experts_tail`)
gives the full recompute's gradients to rounding, and a pipeline that does it trains as one that
computes the output."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from roundpipe.model import experts_tail
from roundpipe.model.experts import quantize_experts_, use_grouped_experts
from roundpipe.model.frozen_tail import mark_tail, tails, unread_tail
from tests.test_frozen_tail import Trained, skipping_recomputes, trained_on_one_worker
from tests.test_moe_parity import tiny_gpt_oss
from tests.test_transformers_parity import lora, tiny_qwen3_moe

MODELS = {"qwen3-moe": tiny_qwen3_moe, "gpt-oss": tiny_gpt_oss}


def moe_layer(kind: str, router_trains: bool = False) -> nn.Module:
    """Decoder layer 0 of a tiny LoRA model (q/k/v/o) with random non-zero weights and biases, its
    experts grouped as in roundpipe's copies; the router trains with ``router_trains``."""
    model = MODELS[kind]()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name or "router" in name or "gate" in name:
                param.normal_(0.0, 0.3)
    layer: nn.Module = lora(model).get_submodule("base_model.model.model.layers.0")
    assert use_grouped_experts(layer) == 1
    if router_trains:
        router = layer.mlp.router if kind == "gpt-oss" else layer.mlp.gate
        router.weight.requires_grad_(True)
    return layer


def rotary(layer: nn.Module, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Identity rotations for ``tokens`` positions (GPT-OSS rotates halves: half a head wide)."""
    width = layer.self_attn.head_dim // (2 if "GptOss" in type(layer).__name__ else 1)
    return torch.ones(1, tokens, width), torch.zeros(1, tokens, width)


def grads_of(layer: nn.Module, skip: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """The input's and every trainable parameter's gradient of one call of ``layer``."""
    g = torch.Generator().manual_seed(seed)
    config = layer.self_attn.config
    x = torch.randn(2, 8, config.hidden_size, generator=g, requires_grad=True)
    cos, sin = rotary(layer, 8)
    grad = torch.randn(2, 8, config.hidden_size, generator=g)
    layer.zero_grad()
    with unread_tail(tails(layer)) if skip else torch.enable_grad():
        out = layer(x, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    found = {"input": x.grad.clone()}
    found |= {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return found


def counting_skips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = experts_tail._UnreadExperts.forward

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(experts_tail._UnreadExperts, "forward", staticmethod(counted))
    return calls


def assert_close_grads(layer: nn.Module) -> None:
    full, skipped = grads_of(layer, skip=False), grads_of(layer, skip=True)
    assert full.keys() == skipped.keys() and len(full) > 1
    for name in full:
        scale = float(full[name].abs().max())
        assert scale > 0, name  # a gradient that moves, so the comparison says something
        # Sums in another order: fp32 rounding of the largest terms, ~1e-7 of them.
        torch.testing.assert_close(skipped[name], full[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("router_trains", [False, True], ids=["frozen-router", "router-trains"])
def test_a_skipped_experts_output_leaves_the_gradients_as_the_full_call_gives(
    kind: str, router_trains: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = moe_layer(kind, router_trains)
    assert mark_tail(layer) and tails(layer) == [layer.mlp.experts]
    skips = counting_skips(monkeypatch)
    assert_close_grads(layer)
    assert len(skips) == 1  # only the skipping call, and it did skip


@pytest.mark.parametrize("bound", [False, True], ids=["per-call", "run-copy-bound"])
def test_4_bit_experts_skip_and_dequantize_for_the_backward(bound: bool) -> None:
    layer = moe_layer("qwen3-moe")
    experts = layer.mlp.experts
    assert quantize_experts_(experts, block_size=16)
    if bound:  # a stage run's dense copies, as `roundpipe.model.dense_weights` binds them
        from roundpipe.model.experts import dequantized_experts

        for name, dense in dequantized_experts(experts, torch.float32).items():
            setattr(experts, f"{name}_dense", nn.Parameter(dense, requires_grad=False))
    assert mark_tail(layer)
    assert_close_grads(layer)


def test_trained_or_parametrized_experts_keep_their_output() -> None:
    layer = moe_layer("qwen3-moe")
    layer.mlp.experts.down_proj.requires_grad_(True)  # the down weight's gradient needs the rows
    assert not mark_tail(layer)
    model: Any = tiny_qwen3_moe()  # transformers' own experts (not grouped): left alone
    assert not mark_tail(lora(model).get_submodule("base_model.model.model.layers.0"))


def test_without_grad_the_experts_output_is_computed() -> None:
    layer = moe_layer("gpt-oss")
    mark_tail(layer)
    x = torch.randn(1, 4, layer.self_attn.config.hidden_size)
    with torch.no_grad(), unread_tail(tails(layer)):  # a forward stage's call: the value is read
        skipped = layer(x, position_embeddings=rotary(layer, 4))
    with torch.no_grad():
        assert torch.equal(skipped, layer(x, position_embeddings=rotary(layer, 4)))


def test_a_compiled_layer_skips_the_experts_output_in_its_own_graph() -> None:
    torch._dynamo.reset()
    layer = moe_layer("qwen3-moe", router_trains=True)
    mark_tail(layer)
    layer.compile(backend="aot_eager")  # traces the skip's autograd function as inductor does
    full, skipped = grads_of(layer, skip=False), grads_of(layer, skip=True)
    for name in full:
        scale = float(full[name].abs().max())
        torch.testing.assert_close(skipped[name], full[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    x = torch.randn(1, 4, layer.self_attn.config.hidden_size, requires_grad=True)
    with unread_tail(tails(layer)):
        out = layer(x, position_embeddings=rotary(layer, 4))
    # The compiled graph honoured the flag: its output lacks the experts' sum, its gradients do not.
    assert not torch.equal(out, layer(x, position_embeddings=rotary(layer, 4)))
    torch._dynamo.reset()


def trained(grain: str, skip: bool) -> Trained:
    """The two-block Qwen3-MoE LoRA model (layer 0 is the embedding, 1-2 the blocks, 3 the head)."""
    return trained_on_one_worker(lora(tiny_qwen3_moe()), grain, skip, microbatches=2, budget="192KiB")


@pytest.mark.parametrize("grain", ["stage", "layer_input"])
def test_a_pipeline_that_skips_the_experts_output_trains_as_one_that_computes_it(
    grain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    skips = counting_skips(monkeypatch)
    losses, adapters, meta = trained(grain, skip=True)
    assert len(skips) == skipping_recomputes(meta, grain, steps=2, microbatches=2) > 0
    skips.clear()
    expected_losses, expected, _ = trained(grain, skip=False)
    assert not skips
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    for name in expected:
        torch.testing.assert_close(adapters[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
