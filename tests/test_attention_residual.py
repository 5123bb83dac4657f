"""A decoder layer recomputed with its saved post-attention residual (`attention_residual`) gives
the full recompute's gradients and leaves out ``o_proj``'s frozen product."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe.model import attention_residual
from roundpipe.model.frozen_tail import mark_tail, tails, unread_tail
from roundpipe.model.quant import NF4Linear, quantize_frozen_
from tests.helpers import tiny_causal_lm
from tests.test_transformers_parity import lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _layer_and_inputs(kind: str = "qwen3", targets: tuple[str, ...] | None = None) -> tuple[nn.Module, Any]:
    model = tiny_causal_lm(kind, attn="sdpa")
    model = lora(model) if targets is None else lora(model, targets)
    inner = model.get_base_model().model
    layer = copy.deepcopy(inner.layers[0])
    torch.manual_seed(3)
    hidden = torch.randn(2, 8, 32)
    positions = torch.arange(8)[None].expand(2, -1)
    rotary = inner.rotary_emb(hidden, positions)
    return layer, (hidden, rotary)


def _grads(layer: nn.Module, hidden: torch.Tensor, rotary: Any, residual: torch.Tensor | None) -> list[Any]:
    """The input's and every trained weight's gradients of a recompute whose output is a root."""
    x = hidden.clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    with unread_tail(tails(layer)):
        if residual is None:
            out = layer(x, attention_mask=None, position_embeddings=rotary)
        else:
            with attention_residual.using(layer, residual):
                out = layer(x, attention_mask=None, position_embeddings=rotary)
    out = out[0] if isinstance(out, tuple) else out
    torch.manual_seed(5)
    out.backward(torch.randn_like(out))
    return [x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]


def _kept(layer: nn.Module, hidden: torch.Tensor, rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), attention_residual.keeping(layer) as kept:
        out = layer(hidden, attention_mask=None, position_embeddings=rotary)
    assert len(kept) == 1
    return (out[0] if isinstance(out, tuple) else out), kept[0]


@pytest.mark.parametrize(
    ("kind", "nf4"),
    [("qwen3", False), ("llama", False), ("qwen3", True)],
    ids=["qwen3", "llama", "qwen3-nf4"],
)
def test_a_recompute_with_the_kept_residual_gives_the_full_recomputes_gradients(kind: str, nf4: bool) -> None:
    """Dense or 4-bit (`o_proj`'s input gradient then dequantizes its weight in the backward)."""
    layer, (hidden, rotary) = _layer_and_inputs(kind)
    if nf4:
        quantize_frozen_(layer)
        assert isinstance(layer.self_attn.o_proj.base_layer, NF4Linear)
    mark_tail(layer)
    assert attention_residual.install(layer) and attention_residual.installed(layer)
    out, residual = _kept(layer, hidden, rotary)
    full = _grads(layer, hidden, rotary, None)
    skipped = _grads(layer, hidden, rotary, residual)
    assert len(full) == len(skipped) > 1
    for want, got in zip(full, skipped, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The kept residual is the one the layer's output was summed from: out = residual + mlp(...)
    with torch.no_grad():
        mlp_out = layer.mlp(layer.post_attention_layernorm(residual))
    torch.testing.assert_close(out, residual + mlp_out)


def test_the_o_proj_product_is_left_out_only_while_a_residual_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer, (hidden, rotary) = _layer_and_inputs()
    attention_residual.install(layer)
    o_proj = layer.self_attn.o_proj.base_layer
    products: list[str] = []
    monkeypatch.setattr(
        torch.nn.functional, "linear", _counting(torch.nn.functional.linear, products, o_proj.weight)
    )
    _, residual = _kept(layer, hidden, rotary)
    assert products == ["o_proj"]
    products.clear()
    _grads(layer, hidden, rotary, None)
    assert products == ["o_proj"]  # marked, but flagged only inside using()
    products.clear()
    _grads(layer, hidden, rotary, residual)
    assert products == []
    assert o_proj not in tails(layer) and not o_proj.output_unread


def _counting(linear: Any, products: list[str], weight: torch.Tensor) -> Any:
    def counted(x: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if w is weight:
            products.append("o_proj")
        return linear(x, w, *args, **kwargs)

    return counted


def test_a_trained_o_proj_or_a_layer_of_another_kind_is_not_installed() -> None:
    layer, _ = _layer_and_inputs()
    layer.self_attn.o_proj.base_layer.weight.requires_grad_(True)
    assert not attention_residual.install(layer) and not attention_residual.installed(layer)
    assert not attention_residual.install(nn.Sequential(nn.Linear(2, 2)))


def test_compiled_the_layer_keeps_and_uses_the_residual_as_eager() -> None:
    layer, (hidden, rotary) = _layer_and_inputs()
    mark_tail(layer)
    attention_residual.install(layer)
    eager_out, residual = _kept(layer, hidden, rotary)
    eager = _grads(layer, hidden, rotary, residual)
    torch._dynamo.reset()
    compiled = copy.deepcopy(layer)
    compiled.compile(backend="aot_eager", dynamic=False)
    out, kept = _kept(compiled, hidden, rotary)
    torch.testing.assert_close(kept, residual)
    torch.testing.assert_close(out, eager_out)
    for want, got in zip(eager, _grads(compiled, hidden, rotary, kept), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_inductor_on_cuda_keeps_and_uses_the_residual_in_bf16() -> None:
    """The layer as a run compiles it on CUDA (inductor, bf16): the kept residual is the forward's,
    and the recompute given it back-propagates what the full recompute does, to bf16 rounding."""
    layer, (hidden, rotary) = _layer_and_inputs()
    layer = layer.to("cuda", torch.bfloat16)
    hidden, rotary = hidden.to("cuda", torch.bfloat16), tuple(t.to("cuda", torch.bfloat16) for t in rotary)
    mark_tail(layer)
    attention_residual.install(layer)
    torch._dynamo.reset()
    layer.compile(dynamic=False)
    _, residual = _kept(layer, hidden, rotary)
    full = _grads(layer, hidden, rotary, None)
    skipped = _grads(layer, hidden, rotary, residual)
    for want, got in zip(full, skipped, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def test_a_run_saves_residuals_only_where_a_layer_can_keep_one() -> None:
    """Before any device plan (no budget on the CPU): a LoRA decoder model at layer_input does; a
    model without such a layer, or one whose o_proj trains, does not (its schedule waits for no
    residual and counts none on the link)."""
    import roundpipe
    from tests.helpers import mlp

    def residuals(model: nn.Module, **fields: Any) -> bool:
        config = roundpipe.RunConfig(devices="cpu:1", recompute_grain="layer_input", **fields)
        with roundpipe.RoundPipe(model, config=config) as pipe:
            saved = pipe.trace().meta["layer_residuals"]
            assert saved is pipe.runtime.save_residuals
            return bool(saved)

    assert residuals(lora(tiny_causal_lm("qwen3", attn="sdpa")))
    assert not residuals(lora(tiny_causal_lm("qwen3", attn="sdpa")), save_residuals=False)
    assert not residuals(mlp(0, width=8, depth=3))
    trained_o_proj = tiny_causal_lm("qwen3", attn="sdpa")  # every weight trains
    assert not residuals(trained_o_proj)
