"""NF4 quantization against a plain reference written from the QLoRA definition (and bitsandbytes,
where it is installed), the packing layout, the refusals, `NF4Linear` and `quantize_frozen_`."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.errors import ConfigError, ModelError
from roundpipe.model.quant import (
    NF4_CODES,
    NF4Linear,
    NF4Weight,
    apply_base_format,
    count_nf4,
    dequantize_nf4,
    quantize_frozen_,
    quantize_nf4,
)
from roundpipe.optim.host import HostModel
from tests.helpers import tiny_causal_lm


def reference_nf4(weight: torch.Tensor, block: int) -> tuple[list[int], list[float]]:
    """Element by element: the block's absolute maximum, then the index of the nearest code to the
    scaled value (the first, i.e. lower, one on a tie); codes in flattening order, two a byte."""
    flat = weight.detach().reshape(-1).to(torch.float32).tolist()
    codes, scales = [], []
    for start in range(0, len(flat), block):
        values = flat[start : start + block]
        absmax = max(abs(v) for v in values)
        scales.append(absmax)
        inverse = torch.tensor(1.0, dtype=torch.float32) / absmax if absmax > 0 else torch.tensor(0.0)
        for value in values:
            scaled = float(torch.tensor(value, dtype=torch.float32) * inverse)
            distances = [abs(scaled - c) for c in NF4_CODES]
            codes.append(distances.index(min(distances)))
    packed = [(codes[i] << 4) | codes[i + 1] for i in range(0, len(codes), 2)]
    return packed, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_the_reference(dtype: torch.dtype) -> None:
    weight = (torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    q = quantize_nf4(weight)
    packed, scales = reference_nf4(weight, 64)
    assert q.packed.dtype == torch.uint8 and q.packed.tolist() == packed
    assert q.absmax.dtype == torch.float32 and q.absmax.tolist() == pytest.approx(scales, rel=0, abs=0)
    assert q.shape == weight.shape and q.dtype == dtype
    # Dequantized: code times scale, rounded once to the weight's dtype.
    codes = torch.tensor(NF4_CODES)
    index = torch.tensor([[b >> 4, b & 15] for b in packed]).view(-1, 64)
    expected = (codes[index] * torch.tensor(scales)[:, None]).to(dtype).view(weight.shape)
    assert torch.equal(dequantize_nf4(q), expected)


def test_same_bytes_as_bitsandbytes() -> None:
    bnb_functional: Any = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    q = quantize_nf4(weight)
    assert torch.equal(packed.view(-1), q.packed)
    assert torch.equal(state.absmax, q.absmax)
    assert torch.equal(bnb_functional.dequantize_4bit(packed, state), dequantize_nf4(q))


def test_packing_layout_first_element_in_the_high_nibble() -> None:
    weight = torch.zeros(64)
    weight[0], weight[1], weight[2], weight[3] = 2.0, -2.0, 0.0, 1.0  # scale 2: codes 15, 0, 7, 12
    q = quantize_nf4(weight)
    assert q.packed[:2].tolist() == [0xF0, 0x7C]
    assert q.absmax.tolist() == [2.0]
    # Row-major: block 1 of a [2, 64] weight is its second row.
    rows = torch.stack([torch.full((64,), 0.5), torch.full((64,), -3.0)])
    q = quantize_nf4(rows)
    assert q.absmax.tolist() == [0.5, 3.0]
    assert set(q.packed[:32].tolist()) == {0xFF} and set(q.packed[32:].tolist()) == {0x00}


def test_round_trip_error_is_within_half_a_code_gap() -> None:
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    q = quantize_nf4(weight)
    error = (dequantize_nf4(q) - weight).view(-1, 64).abs()
    half_gap = max(b - a for a, b in itertools.pairwise(NF4_CODES)) / 2
    assert bool((error <= q.absmax[:, None] * half_gap * (1 + 1e-6)).all())
    assert float(error.mean()) < 0.1  # about 0.07 of a unit Gaussian's standard deviation
    zeros = quantize_nf4(torch.zeros(128))
    assert torch.equal(dequantize_nf4(zeros), torch.zeros(128))


def test_refusals() -> None:
    with pytest.raises(ModelError, match="multiple of the block size 64"):
        quantize_nf4(torch.randn(10, 10))
    with pytest.raises(ModelError, match="positive even"):
        quantize_nf4(torch.randn(64), block_size=3)
    with pytest.raises(ModelError, match="floating-point"):
        quantize_nf4(torch.ones(64, dtype=torch.int32))
    with pytest.raises(ModelError, match="2-D"):
        NF4Linear(quantize_nf4(torch.randn(2, 4, 16)))
    with pytest.raises(ConfigError, match="nf4"):
        quantize_frozen_(nn.Linear(64, 64), "int8")


def test_nf4_linear_matches_f_linear_on_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = NF4Linear.from_linear(linear)
    assert all(not p.requires_grad for p in layer.parameters())
    assert layer.packed.dtype == torch.uint8 and layer.absmax.dtype == torch.uint8
    weight = layer.dequantized()
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = layer(x)
    expected = F.linear(x_ref, weight, linear.bias.detach())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert layer.packed.grad is None and layer.bias is not None and layer.bias.grad is None


def test_nf4_linear_saves_no_dense_weight_for_backward() -> None:
    layer = NF4Linear.from_linear(nn.Linear(256, 128))
    saved: list[torch.Tensor] = []
    x = torch.randn(2, 256, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert all(t.numel() < 256 * 128 for t in saved)


def test_dtype_casts_leave_the_quantized_bytes_alone() -> None:
    layer = NF4Linear.from_linear(nn.Linear(64, 64))
    packed, absmax = layer.packed.clone(), layer.absmax.clone()
    layer.to(torch.bfloat16)
    assert torch.equal(layer.packed, packed) and torch.equal(layer.absmax, absmax)
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16
    out = layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def lora_model(seed: int = 0) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = tiny_causal_lm("llama", seed=seed)  # untied LM head
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def test_quantize_frozen_replaces_the_frozen_linears_only() -> None:
    model = lora_model()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    dense_base = q_proj.base_layer
    quantize_frozen_(model)
    # 2 layers x (q, k, v, o, gate, up, down): the LoRA base layers and the plain frozen ones.
    assert count_nf4(model) == 14
    assert isinstance(q_proj.base_layer, NF4Linear) and dense_base.weight.is_meta
    assert type(q_proj.lora_A["default"]) is nn.Linear  # trainable: left alone
    assert type(model.base_model.model.lm_head) is nn.Linear  # the LM head: left alone
    assert isinstance(model.base_model.model.model.embed_tokens, nn.Embedding)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for name, param in trainable.items():
        assert torch.equal(param, original[name])
    expected = quantize_nf4(original["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert torch.equal(q_proj.base_layer.packed, expected.packed)


def test_quantized_lm_head_when_asked_and_untied() -> None:
    model = tiny_causal_lm("llama")
    model.requires_grad_(False)
    quantize_frozen_(model, include_lm_head=True)
    assert isinstance(model.lm_head, NF4Linear)
    tied = tiny_causal_lm("qwen3")  # its head shares the embedding's weight: never quantized
    tied.requires_grad_(False)
    quantize_frozen_(tied, include_lm_head=True)
    assert type(tied.lm_head) is nn.Linear


def test_apply_base_format_refuses_a_model_with_nothing_frozen() -> None:
    with pytest.raises(ConfigError, match=r"no frozen nn\.Linear"):
        apply_base_format(nn.Sequential(nn.Linear(64, 64)), "nf4")
    already = nn.Sequential(NF4Linear.from_linear(nn.Linear(64, 64)), nn.Linear(4, 4))
    apply_base_format(already, "nf4")  # holds NF4Linears: accepted
    dense = nn.Sequential(nn.Linear(64, 64))
    apply_base_format(dense, "compute")
    assert type(dense[0]) is nn.Linear


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_host_copies_keep_the_quantized_bytes(precision: str) -> None:
    torch.manual_seed(0)
    frozen = nn.Linear(64, 64)
    frozen.requires_grad_(False)
    model = nn.Sequential(frozen, nn.Linear(64, 8))
    quantize_frozen_(model)
    layer = model[0]
    packed, absmax = layer.packed.detach().clone(), layer.absmax.detach().clone()
    host = HostModel(list(model), model, precision=precision)
    assert host.compute[id(layer.packed)].dtype == torch.uint8
    assert torch.equal(host.compute[id(layer.packed)], packed)
    assert torch.equal(host.compute[id(layer.absmax)], absmax)
    element = 4 if precision == "fp32" else 2
    expected = 64 * 64 // 2 + 64 * 64 // 64 * 4 + 64 * element
    assert host.param_bytes()[0] == expected


def test_quantized_model_deep_copies_and_runs() -> None:
    model = lora_model()
    quantize_frozen_(model)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, twin(input_ids=ids).logits, rtol=0, atol=0)


def test_nf4_weight_sizes() -> None:
    q = quantize_nf4(torch.randn(128, 64))
    assert isinstance(q, NF4Weight) and q.numel == 128 * 64
    assert q.nbytes == 128 * 64 // 2 + 128 * 4


def test_profile_counts_the_4_bit_bytes_and_the_dequantized_weight() -> None:
    from roundpipe.backends.profile import profile_layers

    frozen = nn.Linear(64, 128)
    frozen.requires_grad_(False)
    model = quantize_frozen_(nn.Sequential(frozen, nn.Linear(128, 8)))
    memory, _, _ = profile_layers(
        list(model), torch.randn(4, 64), torch.device("cpu"), computes_loss=False, dtype=torch.bfloat16
    )
    assert memory.param_bytes[0] == 64 * 128 // 2 + 64 * 128 // 64 * 4 + 128 * 2
    assert memory.work_bytes[0] >= 64 * 128 * 2 and memory.bwd_work_bytes[0] >= 64 * 128 * 2
    assert memory.work_bytes[1] == 0


def test_nf4_linear_compiles_into_one_graph_with_the_eager_numbers() -> None:
    """A compiled decoder layer must trace its NF4 linears: a graph break (or a failed trace)
    would run the dequantization eagerly, at a tenth of the fused kernel's rate on a GPU."""
    import torch._dynamo

    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(256, 512, bias=False).requires_grad_(False))
    x = torch.randn(8, 256, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(layer(x)).sum()

    explained = torch._dynamo.explain(loss)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    (eager_grad,) = torch.autograd.grad(loss(x), x)
    compiled = torch.compile(loss, backend="aot_eager")
    (compiled_grad,) = torch.autograd.grad(compiled(x), x)
    torch.testing.assert_close(compiled_grad, eager_grad)
