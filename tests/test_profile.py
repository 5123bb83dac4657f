"""Per-layer profiling on the CPU (exact saved bytes where autograd's choice is known), and the
budget helpers' arithmetic with CUDA's answers stubbed."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from roundpipe.backends import budget, profile
from roundpipe.backends.cuda import _release_cublas_workspaces as release_cublas_workspaces
from roundpipe.backends.profile import activation_bytes, measure_layers, profile_layers
from roundpipe.errors import ConfigError, StageError
from roundpipe.model.sequence import to_layer_sequence
from roundpipe.plan import Plan
from roundpipe.plan.memory import predict_peak
from tests.helpers import tiny_causal_lm

CPU = torch.device("cpu")
BATCH = 5
FP32 = 4


def linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 32), nn.Linear(32, 4))


def test_linear_layers_save_exactly_their_inputs(one_torch_thread: None) -> None:
    model = linears()
    memory, fwd_ms, bwd_ms = profile_layers(list(model), torch.randn(BATCH, 8), CPU, computes_loss=False)
    # Linear saves its input (the weight is a parameter, not counted); Tanh saves its output.
    assert memory.saved_bytes == (BATCH * 8 * FP32, BATCH * 16 * FP32, BATCH * 16 * FP32, BATCH * 32 * FP32)
    assert memory.boundary_bytes == (
        BATCH * 8 * FP32,
        BATCH * 16 * FP32,
        BATCH * 16 * FP32,
        BATCH * 32 * FP32,
    )
    assert memory.param_bytes == ((8 * 16 + 16) * FP32, 0, (16 * 32 + 32) * FP32, (32 * 4 + 4) * FP32)
    assert memory.grad_bytes == memory.param_bytes
    assert memory.work_bytes == (0, 0, 0, 0) and memory.bwd_work_bytes == (
        0,
        0,
        0,
        0,
    )  # not measurable on CPU
    assert len(fwd_ms) == len(bwd_ms) == 4 and all(t >= 0 for t in (*fwd_ms, *bwd_ms))


def test_frozen_parameters_have_no_gradient_bytes_and_user_weights_stay_untouched(
    one_torch_thread: None,
) -> None:
    model = linears()
    model[0].requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory, _, _ = profile_layers(list(model), torch.randn(BATCH, 8), CPU, computes_loss=False)
    assert memory.grad_bytes[0] == 0 and memory.param_bytes[0] == (8 * 16 + 16) * FP32
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())


class _SeesItsWeight(nn.Linear):
    """A linear that records, per call, grad mode and whether its weight requires grad."""

    seen: ClassVar[list[tuple[bool, bool]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SeesItsWeight.seen.append((torch.is_grad_enabled(), self.weight.requires_grad))
        return super().forward(x)


def test_calls_without_grad_see_weights_that_require_none_as_a_forward_stage_binds_them(
    one_torch_thread: None,
) -> None:
    """A compiled layer guards on its weights' ``requires_grad``: the profile's calls must come in
    the stages' combinations only (without grad: none required; with grad: the trained ones)."""
    _SeesItsWeight.seen = []
    layers = [_SeesItsWeight(8, 8), _SeesItsWeight(8, 8)]
    layers[1].requires_grad_(False)
    measure_layers(layers, torch.randn(BATCH, 8), CPU, computes_loss=False)
    seen = set(_SeesItsWeight.seen)
    assert (False, False) in seen and (True, True) in seen
    assert (False, True) not in seen
    assert all(p.requires_grad for p in layers[0].parameters())


def test_profiling_leaves_the_random_stream_alone(one_torch_thread: None) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    sample = torch.randn(BATCH, 8)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    profile_layers(list(model), sample, CPU, computes_loss=False)
    assert torch.equal(torch.rand(3), expected)


def test_loss_fn_runs_on_the_last_layer(one_torch_thread: None) -> None:
    model = linears()
    target = torch.randn(BATCH, 4)
    plain, _, _ = profile_layers(list(model), torch.randn(BATCH, 8), CPU, computes_loss=False)
    with_loss, _, _ = profile_layers(
        list(model),
        torch.randn(BATCH, 8),
        CPU,
        computes_loss=False,
        loss_fn=nn.functional.mse_loss,
        target=target,
    )
    # mse saves the prediction and the target besides the last Linear's input.
    assert with_loss.saved_bytes[-1] == plain.saved_bytes[-1] + 2 * BATCH * 4 * FP32
    assert with_loss.saved_bytes[:-1] == plain.saved_bytes[:-1]


def test_compute_precision_halves_bytes(one_torch_thread: None) -> None:
    model = linears()
    fp32, _, _ = profile_layers(list(model), torch.randn(BATCH, 8), CPU, computes_loss=False)
    bf16, _, _ = profile_layers(
        list(model), torch.randn(BATCH, 8), CPU, computes_loss=False, dtype=torch.bfloat16
    )
    assert bf16.param_bytes == tuple(b // 2 for b in fp32.param_bytes)
    assert bf16.saved_bytes == tuple(b // 2 for b in fp32.saved_bytes)


class DictLayer(nn.Module):
    """Carries a constant under "_rope" and scales "hidden"."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"hidden": x["hidden"] * self.scale + x["_rope"], "_rope": x["_rope"], "ids": x["ids"]}


def test_dict_activations_count_carried_constants_once(one_torch_thread: None) -> None:
    sample = {
        "hidden": torch.randn(BATCH, 6),
        "_rope": torch.randn(BATCH, 6),
        "ids": torch.zeros(BATCH, dtype=torch.long),
    }
    assert activation_bytes(sample) == (2 * BATCH * 6 * FP32 + BATCH * 8, BATCH * 6 * FP32)
    layers = [DictLayer(), DictLayer()]
    memory, _, _ = profile_layers(layers, sample, CPU, computes_loss=False, names=["a", "b"])
    assert memory.carried_bytes == (BATCH * 6 * FP32,) * 2
    assert memory.saved_bytes == (BATCH * 6 * FP32,) * 2  # mul saves the hidden input (scale is a parameter)
    assert memory.names == ("a", "b")


def test_a_failing_layer_is_named() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch")

    with pytest.raises(
        StageError, match=r"layer 1 \('bad'\) raised RuntimeError while being profiled on cpu"
    ):
        measure_layers(
            [nn.Identity(), Broken()], torch.randn(2, 2), CPU, computes_loss=False, names=["ok", "bad"]
        )


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB"),
        # inductor's autotuning, compiling a layer, re-raises the allocator's error as its message
        RuntimeError("Failed to run autotuning code block: CUDA out of memory. Tried to allocate 7.00 GiB"),
    ],
    ids=["allocator", "autotuning"],
)
def test_a_layer_out_of_memory_while_profiled_is_an_out_of_memory_error(error: Exception) -> None:
    """The long-row slicing levels move on only on this error: a layer that does not fit whole,
    however the failure reaches the profiler, must not read as a broken layer."""
    from roundpipe.errors import DeviceOutOfMemoryError

    class TooBig(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                raise error
            except Exception as inner:  # one layer further from the allocator: chained
                raise RuntimeError("compiling the layer failed") from inner

    with pytest.raises(DeviceOutOfMemoryError, match=r"out of memory profiling layer 1 \('big'\)"):
        measure_layers(
            [nn.Identity(), TooBig()], torch.randn(2, 2), CPU, computes_loss=False, names=["ok", "big"]
        )


def test_transformer_saved_bytes_grow_linearly_with_tokens(one_torch_thread: None) -> None:
    model = tiny_causal_lm("qwen3", attn="sdpa")
    seq = to_layer_sequence(model)

    def measure(tokens: int) -> tuple[int, ...]:
        torch.manual_seed(3)
        ids = torch.randint(0, 64, (2, tokens))
        memory, fwd_ms, bwd_ms = profile_layers(
            seq.layers, {"input_ids": ids, "labels": ids}, CPU, computes_loss=True, names=seq.names
        )
        assert memory.names == tuple(seq.names) and len(fwd_ms) == len(bwd_ms) == len(seq.layers)
        # the LM head's weight gradient, computed in its forward, is parameter-sized
        head_weight = model.lm_head.weight
        assert memory.saved_grad_bytes[-1] == head_weight.numel() * head_weight.element_size()
        assert not any(memory.saved_grad_bytes[:-1])
        return tuple(s - g for s, g in zip(memory.saved_bytes, memory.saved_grad_bytes, strict=True))

    short, long = measure(32), measure(64)
    assert all(b > 0 for b in short)
    for name, a, b in zip(seq.names, short, long, strict=True):
        assert b == pytest.approx(2 * a, rel=0.10), name
    assert sum(long) == pytest.approx(2 * sum(short), rel=0.10)
    assert all(p.grad is None for p in model.parameters())


def test_profiled_facts_feed_the_plan_prediction(one_torch_thread: None) -> None:
    seq = to_layer_sequence(tiny_causal_lm("qwen3", attn="sdpa"))
    ids = torch.randint(0, 64, (1, 16))
    memory, _, _ = profile_layers(seq.layers, {"input_ids": ids, "labels": ids}, CPU, computes_loss=True)
    n = len(seq.layers)
    plan = Plan((range(0, 2),), range(2, n), (range(0, 2),), t_max=1.0, num_devices=1, num_microbatches=2)
    prediction = predict_peak(plan, memory, "layer")
    assert prediction.peak_bytes > sum(memory.param_bytes[2:]) + sum(memory.saved_bytes[2:])


def test_allocator_branch_runs_with_a_stubbed_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA arithmetic on the CPU: an allocator that reports 1000 bytes more after each
    query and a peak 500 above that; every figure comes out as a whole number of bytes >= 0."""
    counter = iter(range(0, 10**6, 1000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(counter))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10**6 + 500)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    meter = profile._Meter(CPU)
    meter.cuda = True
    found, _ = profile._measure_layer(1, "l", nn.Linear(8, 4), torch.randn(BATCH, 8), meter, None, None)
    assert found.saved_alloc_bytes is not None and found.saved_hook_bytes == BATCH * 8 * FP32
    assert found.saved_bytes == max(found.saved_hook_bytes, found.saved_alloc_bytes)
    assert found.work_bytes > 0 and found.bwd_work_bytes > 0


# ---------------------------------------------------------------------- budget helpers


class FakeProps:
    total_memory = 80 * 2**30


def test_enforce_budget_sets_the_fraction_of_the_card(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: FakeProps())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    assert budget.enforce_budget(1, 24 * 2**30) == pytest.approx(0.3)
    assert budget.enforce_budget(0, 100 * 2**30) == 1.0  # larger than the card: no cap
    assert calls == [(pytest.approx(0.3), 1), (1.0, 0)]
    with pytest.raises(ConfigError, match="must be positive"):
        budget.enforce_budget(0, 0)


def test_default_budget_is_free_memory_less_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * 2**30, 80 * 2**30))
    assert budget.default_budget(0) == 70 * 2**30 - 4 * 2**30  # 5% of 80 GiB beats 1 GiB
    assert budget.default_budget(0, reserve_bytes=2**30) == 69 * 2**30
    assert budget.default_reserve_bytes(16 * 2**30) == 2**30  # 1 GiB beats 5% of 16 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (2**29, 24 * 2**30))
    with pytest.raises(ConfigError, match=r"cuda:0 has only 512.00 MiB free .*memory_budget"):
        budget.default_budget(0)


@pytest.mark.gpu
def test_cuda_profile_cross_checks_saved_bytes() -> None:
    seq = to_layer_sequence(tiny_causal_lm("qwen3", attn="sdpa"))
    ids = torch.randint(0, 64, (2, 256))
    # cuBLAS keeps a workspace per (handle, stream) from the caching allocator until told to
    # free it: not a copy the profile left behind, and whether one exists already depends on
    # which test ran before this one in the process.
    release_cublas_workspaces()
    before = torch.cuda.memory_allocated()
    found = measure_layers(
        seq.layers,
        {"input_ids": ids, "labels": ids},
        torch.device("cuda"),
        computes_loss=True,
        dtype=torch.bfloat16,
    )
    for m in found:
        assert m.saved_alloc_bytes is not None and m.saved_bytes >= m.saved_hook_bytes
    release_cublas_workspaces()
    assert torch.cuda.memory_allocated() - before < 2**20  # every device copy freed


def test_release_budget_lifts_the_cap_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from roundpipe.planning.device_plan import release_budget

    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: FakeProps())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    release_budget("cuda", (0, 1), 24 * 2**30)
    release_budget("cuda", (0,), 100 * 2**30)  # no cap was set: nothing to lift
    release_budget("cuda", (0,), None)
    release_budget("cpu", (0,), 2**30)
    assert calls == [(1.0, 0), (1.0, 1)]


@pytest.mark.parametrize("keep", [False, True])
def test_a_profile_for_a_run_that_saves_residuals_measures_them(one_torch_thread: None, keep: bool) -> None:
    """Its calls without grad keep each decoder layer's post-attention residual, as the run's
    forward stages will (`roundpipe.model.attention_residual`): a hidden state per block, none
    for the embedding and the head; without, none anywhere."""
    from roundpipe.backends.compiling import LayerCompiler
    from tests.test_transformers_parity import lora

    seq = to_layer_sequence(lora(tiny_causal_lm("qwen3", vocab=64, attn="sdpa")))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    memory, _, _ = profile_layers(
        seq.layers,
        {"input_ids": ids, "labels": ids},
        CPU,
        computes_loss=True,
        prepare=LayerCompiler(False, "cpu").prepare,  # roundpipe's copies: the blocks can keep them
        keep_residuals=keep,
    )
    hidden = 2 * 16 * 32 * FP32
    assert memory.residual_bytes == ((0, hidden, hidden, 0) if keep else (0, 0, 0, 0))
