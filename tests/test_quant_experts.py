"""Frozen mixture-of-experts weights in NF4 (`roundpipe.model.experts.quantize_experts_`).

The references: the grouped experts block run on the dequantized weights (the same numbers, with
the dense weights as ordinary frozen parameters), and a plain loop over the same quantized model.
Checked besides: autograd keeps no dense expert weight for the backward, nothing is read on the
host, a block uploads 0.5625 bytes per expert element instead of bf16's 2, and the profile counts
the transient dense weight as working set. Tiny Qwen3-MoE and GPT-OSS configs, fp32 on CPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.model.experts import EXPERT_WEIGHTS, NF4Meta, dequantized_experts, quantize_experts_
from roundpipe.model.quant import count_nf4, quantize_frozen_
from tests.test_moe_experts import (
    IDS,
    MODELS,
    HostReads,
    counted_calls,
    eager,
    mlp_pair,
    profiled_on_cpu,
    qkvo_lora,
    run_block,
    scatters_in_backward,
)
from tests.test_moe_parity import accumulation_loop, padded_data
from tests.test_transformers_parity import pipe_loop, sgd, token_data


def frozen_pair(make: Any) -> tuple[nn.Module, nn.Module]:
    """A grouped MoE block with frozen experts, and a copy whose experts are held in NF4 and whose
    first has the dequantized values as its dense weights."""
    _, grouped = mlp_pair(make)
    for name, param in grouped.named_parameters():
        param.requires_grad_("experts" not in name)
    quantized = copy.deepcopy(grouped)
    assert quantize_experts_(quantized.experts, 64)
    with torch.no_grad():
        for name, dense in dequantized_experts(quantized.experts).items():
            getattr(grouped.experts, name).copy_(dense)
    return grouped, quantized


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_equal_the_grouped_block_on_the_dequantized_weights(make: Any) -> None:
    dense, quantized = frozen_pair(make)
    assert {n for n, _ in quantized.experts.named_parameters()} >= {
        f"{w}_{part}" for w in EXPERT_WEIGHTS for part in ("packed", "absmax")
    }
    assert not any(hasattr(quantized.experts, w) for w in EXPERT_WEIGHTS)
    assert all(p.dtype == torch.uint8 for n, p in quantized.experts.named_parameters() if "bias" not in n)
    torch.manual_seed(2)
    x, weight = torch.randn(3, 11, 32), torch.randn(3, 11, 32)
    want, want_dx = run_block(dense, x, weight)
    got, got_dx = run_block(quantized, x, weight)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=0, atol=1e-6)
    reference = dict(dense.named_parameters())
    for name, param in quantized.named_parameters():
        if param.requires_grad:  # the router
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, reference[name].grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_through_roundpipes_operator_give_the_same_numbers(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the products dispatched as roundpipe::grouped_mm (layers compiled with the C++
    wrapper), the 4-bit block's outputs and gradients are those of the direct products, bit for
    bit, and the operator runs for the forward's two products and the input gradient's two."""
    from roundpipe.model import grouped_mm as grouped_module
    from roundpipe.model.experts import dispatch_products

    _, quantized = frozen_pair(make)
    dispatched = copy.deepcopy(quantized)
    assert dispatch_products(dispatched) == 1
    torch.manual_seed(2)
    x, weight = torch.randn(3, 11, 32), torch.randn(3, 11, 32)
    want, want_dx = run_block(quantized, x, weight)
    calls = counted_calls(monkeypatch, grouped_module, "_grouped_mm_op")
    got, got_dx = run_block(dispatched, x, weight)
    assert torch.equal(got, want) and torch.equal(got_dx, want_dx)
    assert len(calls) == 4


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_autograd_keeps_no_dense_expert_weight(make: Any) -> None:
    """What the block saves for its backward: the 4-bit bytes, never a dense expert matrix."""
    dense, quantized = frozen_pair(make)
    meta: dict[str, NF4Meta] = getattr(quantized.experts, "nf4_meta")  # noqa: B009
    dense_sizes = {m.numel for m in meta.values()}

    def saved_sizes(block: nn.Module) -> list[int]:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point():
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(torch.randn(2, 9, 32, requires_grad=True))
        return sizes

    assert dense_sizes & set(saved_sizes(dense))  # a plain grouped product saves its weight
    assert not dense_sizes & set(saved_sizes(quantized))


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_never_read_a_tensor_on_the_host(make: Any) -> None:
    _, quantized = frozen_pair(make)
    with HostReads() as reads:
        run_block(quantized, torch.randn(2, 9, 32), torch.ones(2, 9, 32))
    assert reads.calls == []


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_back_propagate_without_a_scatter(make: Any) -> None:
    _, quantized = frozen_pair(make)
    assert scatters_in_backward(quantized) == []


def test_trainable_or_ragged_experts_stay_dense() -> None:
    _, grouped = mlp_pair(MODELS[0])
    assert not quantize_experts_(grouped.experts, 64)  # trainable: LoRA or a full fine-tune
    grouped.experts.requires_grad_(False)
    assert not quantize_experts_(grouped.experts, 3 * 64)  # blocks would straddle two experts
    parametrized = copy.deepcopy(grouped.experts)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "down_proj", nn.Identity())
    parametrized.requires_grad_(False)
    assert not quantize_experts_(parametrized, 64)  # as peft's LoRA on experts computes them
    assert quantize_experts_(grouped.experts, 64)
    assert not quantize_experts_(grouped.experts, 64)  # already quantized


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_lora_moe_through_the_pipe_matches_a_plain_loop(make: Any) -> None:
    model: Any = qkvo_lora(eager(make(router_logits=True)))
    reference = quantize_frozen_(copy.deepcopy(model))  # the bytes the pipe will make
    layers = model.config.num_hidden_layers
    assert count_nf4(reference) == layers * 5  # q, k, v, o and the experts of every block
    data = padded_data(2)
    expected = accumulation_loop(reference, data)
    assert pipe_loop(model, data, base_format="nf4") == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert count_nf4(model) == layers * 5
    got = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def uploaded(base_format: str) -> dict[str, tuple[int, int]]:
    """Per parameter of the first decoder block: (copies, bytes) the runtime uploaded over one
    iteration in bf16."""
    from tests.test_transformers_parity import tiny_qwen3_moe

    model = qkvo_lora(eager(tiny_qwen3_moe()))
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="bf16", base_format=base_format
    )
    moved: dict[str, tuple[int, int]] = {}
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        names = {id(pipe.host.compute[id(p)]): name for name, p in pipe.host.layer_params[1]}
        pool: Any = pipe.runtime.pool
        copy_of = pool.copy_of

        def recording(source: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
            name = names.get(id(source))
            if name is not None:
                count, size = moved.get(name, (0, 0))
                moved[name] = (count + 1, size + source.numel() * source.element_size())
            return copy_of(source, device, requires_grad)

        pool.copy_of = recording
        pipe.forward_backward(token_data(1)[0], None, None)
        pipe.step()
        pipe.synchronize()
    return moved


def test_a_moe_block_uploads_its_experts_in_a_quarter_of_the_bf16_bytes() -> None:
    dense, quantized = uploaded("compute"), uploaded("nf4")
    dense_experts = {
        n: v for n, v in dense.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    nf4_experts = {n: v for n, v in quantized.items() if ".experts." in n}
    assert len(dense_experts) == 2 and len(nf4_experts) == 4
    uploads = {count for count, _ in [*dense_experts.values(), *nf4_experts.values()]}
    assert len(uploads) == 1 and min(uploads) >= 2  # every expert tensor, each upload of the block
    elements = sum(size for _, size in dense_experts.values()) // 2  # bf16
    nf4_bytes = sum(size for _, size in nf4_experts.values())
    assert nf4_bytes == elements * (0.5 + 4 / 64)
    assert nf4_bytes / sum(size for _, size in dense_experts.values()) == pytest.approx(0.28125)
    rest = {n: v for n, v in quantized.items() if ".experts." not in n and "_proj" not in n}
    assert rest == {n: v for n, v in dense.items() if n in rest} and rest  # norms, router, adapters


def test_the_profile_counts_the_dense_expert_weight_as_working_set() -> None:
    """On a CPU the profile's working set of a block is the largest dense weight its call makes:
    with NF4 experts, the dequantized ``gate_up_proj``."""
    from roundpipe.model.transformers_presets import causal_lm_layers
    from tests.test_transformers_parity import tiny_qwen3_moe

    model: Any = eager(tiny_qwen3_moe())
    for name, param in model.named_parameters():
        param.requires_grad_("experts" not in name)
    quantize_frozen_(model)
    assert count_nf4(model) == model.config.num_hidden_layers
    layers, names = causal_lm_layers(model)
    measured = profiled_on_cpu(layers, names)
    config = model.config
    gate_up_bytes = config.num_experts * 2 * config.moe_intermediate_size * config.hidden_size * 4
    assert all(m.work_bytes == m.bwd_work_bytes == gate_up_bytes for m in measured[1:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_bf16_on_cuda_without_syncing(make: Any, compiled: bool) -> None:
    """On CUDA in bf16 the NF4 block equals the grouped block on the dequantized weights (to bf16's
    rounding of the products) and never waits for the device after its first call."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dense, quantized = frozen_pair(make)
    dense, quantized = dense.to("cuda", torch.bfloat16), quantized.to("cuda", torch.bfloat16)
    quantized.experts.compiled = compiled
    torch.manual_seed(2)
    x = torch.randn(4, 128, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4, 128, 32, device="cuda", dtype=torch.bfloat16)
    want, want_dx = run_block(dense, x, weight)
    run_block(quantized, x, weight)  # first call: the byte table, kernels (and the compile) load
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, got_dx = run_block(quantized, x, weight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_dx.float(), want_dx.float(), rtol=2e-2, atol=5e-2)
