"""Experts as grouped matrix products (`roundpipe.model.experts`) equal transformers' eager experts.

The reference is always transformers' own loop over experts (``experts_implementation="eager"``),
in fp32 on CPU: outputs, the router's and the experts' gradients of one MoE block; then whole
training runs through RoundPipe on ``cpu:2`` (LoRA on q/k/v/o with frozen experts, and a full
fine-tune, both with the router auxiliary loss) against the plain loop at the same microbatches.
The grouped path must never read a tensor on the host (no round trip per expert); on CUDA, a
bf16 test runs it under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import roundpipe.model.experts as experts_module
from roundpipe.model import expert_products
from roundpipe.model.experts import use_grouped_experts
from roundpipe.model.grouped_mm import grouped_mm
from roundpipe.model.routing import gather_rows, inverse_order, route, unsort_rows
from tests.test_moe_parity import accumulation_loop, padded_data, tiny_gpt_oss
from tests.test_transformers_parity import assert_same_weights, pipe_loop, tiny_qwen3_moe
from tests.test_transformers_parity import lora as qkvo_lora

MODELS = [tiny_qwen3_moe, tiny_gpt_oss]
IDS = ["qwen3-moe", "gpt-oss"]
# Each of these reads a tensor's value on the host: on a GPU, a wait for everything queued.
HOST_READS = frozenset(
    {"item", "tolist", "nonzero", "cpu", "numpy", "unique", "bincount", "__bool__", "__int__", "__float__"}
)


def eager(model: Any) -> Any:
    """``model`` with transformers' loop over experts (the reference), on any transformers 5."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    elif hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model


def tiny_qwen3_moe_odd(seed: int = 0) -> nn.Module:
    """Expert width 6: 24-byte fp32 rows, which the grouped kernel cannot take unpadded."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=6,
        num_experts=5,
        num_experts_per_tok=3,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def mlp_pair(make: Any) -> tuple[nn.Module, nn.Module]:
    """One MoE block with eager experts and a grouped copy of it (random non-zero weights)."""
    mlp = eager(make()).model.layers[0].mlp
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.3)
    grouped = copy.deepcopy(mlp)
    assert use_grouped_experts(grouped) == 1
    return mlp, grouped


def run_block(mlp: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out = mlp(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * weight).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.parametrize("make", [*MODELS, tiny_qwen3_moe_odd], ids=[*IDS, "qwen3-moe-unaligned"])
def test_grouped_block_matches_eager_experts(make: Any) -> None:
    mlp, grouped = mlp_pair(make)
    hidden = mlp.experts.gate_up_proj.shape[2 if type(mlp).__name__.startswith("Qwen") else 1]
    torch.manual_seed(2)
    x = torch.randn(3, 11, hidden)
    weight = torch.randn(3, 11, hidden)
    want, want_dx = run_block(mlp, x, weight)
    got, got_dx = run_block(grouped, x, weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-5)
    reference = dict(mlp.named_parameters())
    for name, param in grouped.named_parameters():  # router and every expert weight / bias
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=1e-5, atol=1e-5, msg=name)


class HostReads(TorchFunctionMode):
    """Records every call, made while active, of a function that reads a tensor on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "where" and len(args) == 1 and not kwargs):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_grouped_experts_never_read_a_tensor_on_the_host(make: Any) -> None:
    mlp, grouped = mlp_pair(make)
    hidden = torch.randn(2, 9, 32)
    with HostReads() as reads:
        run_block(grouped, hidden, torch.ones(2, 9, 32))
    assert reads.calls == []
    with HostReads() as reads:  # the eager loop does, once per expert: the check can fail
        run_block(mlp, hidden, torch.ones(2, 9, 32))
    assert "nonzero" in reads.calls or "where" in reads.calls


def test_route_sorts_by_expert_with_offsets_on_the_device() -> None:
    index = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 2]])
    routing = route(index, num_experts=5)
    assert routing.expert.tolist() == [0, 0, 1, 2, 2, 2, 2, 3]
    assert routing.token.tolist() == [0, 3, 1, 0, 1, 2, 3, 2]
    assert routing.offsets.dtype == torch.int32
    assert routing.offsets.tolist() == [2, 3, 7, 8, 8]  # expert 4: empty group


class Accumulations(TorchDispatchMode):
    """Records every aten call, while active, that scatters with accumulation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if name.startswith(("index_add", "scatter_add")) or ("index_put" in name and accumulate):
            self.calls.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_permutations_back_propagate_as_indexing_does_without_scattering(dtype: torch.dtype) -> None:
    """`gather_rows` and `unsort_rows` give indexing's values, and its gradients up to the order
    of each token's k additions (summed in fp32 and rounded once; autograd's index accumulation on
    CPU rounds after each), and their backward scatters nothing: the check records autograd's own
    indexing doing so."""
    torch.manual_seed(3)
    tokens, k, experts, width = 13, 3, 5, 8
    routing = route(torch.rand(tokens, experts).topk(k, dim=-1).indices, experts)
    inverse = inverse_order(routing)
    hidden = torch.randn(tokens, width).to(dtype)
    weight = torch.randn(tokens * k, width).to(dtype)

    def run(gather: Any, unsort: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        x = hidden.to(dtype).requires_grad_(True)
        out = unsort(gather(x) * 2.0)
        with Accumulations() as scatters:
            (out * weight.to(dtype)).sum().backward()
        assert x.grad is not None
        return out.detach(), x.grad, scatters.calls

    # The reference: autograd's indexing in fp32 on the same values.
    want, want_grad, indexing_scatters = run(
        lambda x: x[routing.token], lambda rows: rows[inverse], torch.float32
    )
    got, got_grad, scatters = run(
        lambda x: gather_rows(x, routing, inverse, k), lambda rows: unsort_rows(rows, routing, inverse), dtype
    )
    assert torch.equal(got.float(), want)
    # fp32: the order of the k additions; bf16: one rounding of the fp32 sum (2^-9 relative).
    torch.testing.assert_close(
        got_grad.float(), want_grad, rtol=2**-8 if dtype == torch.bfloat16 else 1e-6, atol=1e-6
    )
    assert indexing_scatters and scatters == []


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_a_grouped_blocks_backward_scatters_nothing(make: Any) -> None:
    """With frozen experts (LoRA on attention), the grouped block's backward, router included, adds
    nothing through a scatter: no float atomics on CUDA. transformers' loop does (index_add_)."""
    mlp, grouped = mlp_pair(make)
    for block in (mlp, grouped):
        for param in block.experts.parameters():
            param.requires_grad_(False)
    assert scatters_in_backward(grouped) == []
    assert scatters_in_backward(mlp)


def scatters_in_backward(block: nn.Module) -> list[str]:
    """What `Accumulations` records during the backward of ``block`` on a [2, 9, 32] input."""
    inputs = torch.randn(2, 9, 32).requires_grad_(True)
    out = block(inputs)
    out = out[0] if isinstance(out, tuple) else out
    with Accumulations() as recorded:
        out.sum().backward()
    return recorded.calls


def test_grouped_mm_pads_unaligned_widths() -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(7, 5), torch.randn(3, 5, 6)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    want = torch.cat([x[:2] @ weight[0], x[2:] @ weight[2]])
    torch.testing.assert_close(grouped_mm(x, weight, offsets), want)


def test_experts_laid_out_otherwise_run_their_own_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers version with another weight layout: the grouped class falls back to the
    module's own forward (checked on shapes, nothing read)."""
    _, grouped = mlp_pair(tiny_qwen3_moe)
    experts: Any = grouped.experts
    assert experts_module.fits(experts, experts_module.LAYOUTS["Qwen3MoeExperts"])
    experts.down_proj = nn.Parameter(experts.down_proj.detach().transpose(1, 2).clone())
    assert not experts_module.fits(experts, experts_module.LAYOUTS["Qwen3MoeExperts"])
    calls = counted_grouped_calls(monkeypatch)
    with pytest.raises(RuntimeError):  # the eager loop's own products, on the wrong layout
        grouped(torch.randn(1, 3, 32))
    assert calls == []


def test_an_explicit_experts_kernel_is_left_alone() -> None:
    model: Any = tiny_qwen3_moe()
    model.config._experts_implementation = "some_kernel"
    assert use_grouped_experts(model.model.layers[0]) == 0


def counted_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """A list that grows by one at each call of ``module.name`` (patched for the test)."""
    calls: list[int] = []
    original = getattr(module, name)

    def counting(*args: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(module, name, counting)
    return calls


def counted_grouped_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return counted_calls(monkeypatch, experts_module, "grouped_experts")


@pytest.mark.parametrize("lora", [True, False], ids=["lora-qkvo", "full"])
@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_pipe_with_grouped_experts_matches_eager_loop(
    make: Any, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model: Any = eager(make(router_logits=True))
    if lora:
        model = qkvo_lora(model)
    reference = copy.deepcopy(model)
    data = padded_data(2)
    expected = accumulation_loop(reference, data)
    calls = counted_grouped_calls(monkeypatch)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert calls, "the pipe's copies never ran the grouped experts"
    assert_same_weights(model, reference)
    assert not any(getattr(type(m), "_roundpipe_grouped", False) for m in model.modules())  # copies only


@pytest.mark.gpu
@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_grouped_experts_bf16_on_cuda_match_eager_without_syncing(make: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The reference is the eager block on the same device in the same dtype: routing in bf16
    # differs from fp32 routing on near-ties (a few tokens pick another expert), and parity is
    # about the experts' products, not the router's rounding.
    mlp, grouped = mlp_pair(make)
    mlp, grouped = mlp.to("cuda", torch.bfloat16), grouped.to("cuda", torch.bfloat16)
    torch.manual_seed(2)
    x = torch.randn(4, 128, 32)
    weight = torch.randn(4, 128, 32)
    xc, wc = x.to("cuda", torch.bfloat16), weight.to("cuda", torch.bfloat16)
    want, want_dx = (t.float().cpu() for t in run_block(mlp, xc, wc))
    run_block(grouped, xc, wc)  # first call: kernels load, may synchronise once
    grouped.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, got_dx = run_block(grouped, xc, wc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_dx.float().cpu(), want_dx, rtol=2e-2, atol=5e-2)
    reference = dict(mlp.named_parameters())
    for name, param in grouped.named_parameters():
        assert param.grad is not None, name
        expected = reference[name].grad
        assert expected is not None, name
        scale = float(expected.abs().max())
        torch.testing.assert_close(
            param.grad.float().cpu(), expected.float().cpu(), rtol=3e-2, atol=3e-2 * scale, msg=name
        )


@pytest.mark.gpu
@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_moe_lora_compiles_and_trains_on_cuda(make: Any) -> None:
    """The CUDA default (compiled layers, launched from inductor's C++ wrapper, the experts'
    products through roundpipe::grouped_mm) on a model with experts gives the eager pipe's losses
    within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model: Any = qkvo_lora(make())  # without router logits caught per call, the block compiles
    eager_model = copy.deepcopy(model)
    data = padded_data(3)
    options: dict[str, Any] = dict(devices="cuda:0", precision="bf16")
    compiled = pipe_loop(model, data, **options)
    eager = pipe_loop(eager_model, data, compile=False, **options)
    assert all(torch.isfinite(torch.tensor(compiled)))
    assert compiled == pytest.approx(eager, rel=2e-2, abs=2e-2)


def profiled_on_cpu(layers: list[nn.Module], names: list[str]) -> list[Any]:
    """The profile of a tiny causal LM's ``layers`` on a batch of 2 rows of 16 tokens, as a CPU
    run prepares them (uncompiled)."""
    from roundpipe.backends.compiling import LayerCompiler
    from roundpipe.backends.profile import measure_layers

    batch = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
    return measure_layers(
        layers,
        batch,
        torch.device("cpu"),
        computes_loss=True,
        names=names,
        prepare=LayerCompiler(False, "cpu").prepare,
    )


def test_the_profile_measures_the_grouped_layer_and_its_sorted_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planner's memory facts come from the layer copy the run executes: the profile's copy
    runs the grouped experts, and what a block saves for backward covers the routed rows sorted
    by expert and their first projection (S = tokens x k rows)."""
    from roundpipe.model.transformers_presets import causal_lm_layers

    model: Any = eager(tiny_qwen3_moe())
    layers, names = causal_lm_layers(model)
    calls = counted_grouped_calls(monkeypatch)
    measured = profiled_on_cpu(layers, names)
    assert calls
    config = model.config
    rows = 2 * 16 * config.num_experts_per_tok
    sorted_bytes = rows * (config.hidden_size + 2 * config.moe_intermediate_size) * 4
    assert all(m.saved_bytes >= sorted_bytes for m in measured[1:-1])
    assert not any(getattr(type(m), "_roundpipe_grouped", False) for m in model.modules())


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_with_the_cpp_wrapper_on_the_copies_call_roundpipes_operator_and_train_the_same(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where inductor's C++ wrapper is on (chosen in the environment), the compiler routes the
    copies' grouped products through roundpipe::grouped_mm, which that wrapper can call; the run
    trains exactly as with the direct product (the same kernel; a full fine-tune, so the experts'
    weight gradients go through the operator too)."""
    from roundpipe.backends import compiling
    from roundpipe.model import grouped_mm as grouped_module

    routed: list[bool] = []
    direct = grouped_module.grouped_mm

    def watched(*args: Any, dispatched: bool = False) -> torch.Tensor:
        routed.append(dispatched)
        return direct(*args, dispatched=dispatched)

    monkeypatch.setattr(expert_products, "grouped_mm", watched)
    data = padded_data(2)
    losses = {}
    for wrapper in (False, True):
        monkeypatch.setattr(compiling, "_read_cpp_wrapper", lambda on=wrapper: on)
        routed.clear()
        losses[wrapper] = pipe_loop(eager(make(router_logits=True)), data, compile=True)
        assert routed and set(routed) == {wrapper}
    assert losses[True] == losses[False]


def test_fp32_experts_compile_and_train_as_eager() -> None:
    """A compiled experts layer in fp32 (the CLI's default precision, compiled by default on CUDA):
    torch's fake grouped product accepts only bf16, so tracing it failed; it goes through
    roundpipe's operator instead and trains as the eager layer does."""
    data = padded_data(2)
    base = qkvo_lora(tiny_qwen3_moe())  # no router logits caught per call: the block compiles
    compiled = pipe_loop(copy.deepcopy(base), data, compile=True, devices="cpu:1")
    plain = pipe_loop(base, data, compile=False, devices="cpu:1")
    assert compiled == pytest.approx(plain, rel=1e-4, abs=1e-5)
