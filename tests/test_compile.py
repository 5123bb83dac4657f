"""Compiled layers (`RunConfig.compile`) train exactly as eager ones, sharing their graphs.

On CUDA, "auto" compiles decoder layers with inductor (a GPU test times it). Here dynamo runs
with its "eager" backend: the capture, the guards and the rebinding of replica parameter slots on
every call are what can go wrong, and they are the same whatever backend runs the captured graph.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.backends import compiling, profile
from roundpipe.backends.compiling import LayerCompiler, compile_enabled
from roundpipe.model import to_layer_sequence
from tests.helpers import in_another_thread
from tests.test_transformers_parity import (
    assert_same_weights,
    pipe_loop,
    reference_loop,
    sgd,
    tiny_qwen3,
    token_data,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def eager_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setitem(compiling.DEFAULT_OPTIONS, "backend", "eager")


def test_auto_compiles_on_cuda_only() -> None:
    assert not compile_enabled("auto", "cpu") and not compile_enabled(False, "cuda")
    assert compile_enabled(True, "cpu")


def test_cuda_layers_launch_from_the_cpp_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA compiled layers launch their kernels from inductor's C++ wrapper (the host issued
    A's kernels no faster than the GPU ran them with the Python one), unless the environment or
    the tests chose; elsewhere torch.compile's defaults."""
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
    monkeypatch.setenv("CXX", sys.executable)  # stands in for an installed compiler
    assert compiling.wants_cpp_wrapper("cuda") and not compiling.wants_cpp_wrapper("cpu")
    assert compiling.default_options("cuda") == {} == compiling.default_options("cpu")
    assert LayerCompiler(True, "cuda").cpp_wrapper and not LayerCompiler(True, "cpu").cpp_wrapper
    assert not LayerCompiler(False, "cuda").cpp_wrapper
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    assert not compiling.wants_cpp_wrapper("cuda")
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER")
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # no compiler to build the wrapper with
    assert not compiling.wants_cpp_wrapper("cuda")
    monkeypatch.setenv("CXX", sys.executable)
    monkeypatch.setitem(compiling.DEFAULT_OPTIONS, "backend", "eager")
    assert compiling.default_options("cuda") == {"backend": "eager"}
    assert not compiling.wants_cpp_wrapper("cuda")


def test_a_setting_written_everywhere_reaches_every_thread_but_not_a_threads_own() -> None:
    import torch._inductor.config as inductor_config

    before = compiling.read_everywhere(inductor_config, "combo_kernels")
    with compiling.settings_everywhere(inductor_config, {"combo_kernels": not before}):
        assert in_another_thread(lambda: inductor_config.combo_kernels) is (not before)
        assert compiling.read_everywhere(inductor_config, "combo_kernels") is (not before)
        with inductor_config.patch(combo_kernels=before):  # this thread's own value stays its own
            assert inductor_config.combo_kernels is before
            assert in_another_thread(lambda: inductor_config.combo_kernels) is (not before)
    assert in_another_thread(lambda: inductor_config.combo_kernels) is before


def test_the_cpp_wrapper_is_on_while_a_compiling_cuda_run_is_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazily compiled backward reads inductor's global setting (torch 2.11 failed with a
    per-compile option), so the setting is on, for every thread (the lanes compile on their own,
    a backward on autograd's), from the first open run to the last close, and then what it was."""
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_CPP_WRAPPER", raising=False)
    monkeypatch.setenv("CXX", sys.executable)

    def wrapper_on() -> bool:
        return bool(in_another_thread(lambda: inductor_config.cpp_wrapper))

    with compiling.settings_everywhere(inductor_config, {"cpp_wrapper": False}):
        first, second = LayerCompiler(True, "cuda"), LayerCompiler(True, "cuda")
        first.open()
        first.open()  # once per run, however often asked
        second.open()
        assert wrapper_on() and compiling.CPP_WRAPPER.holders == 2
        first.close()
        first.close()
        assert wrapper_on()  # the second run is still open
        second.close()
        assert not wrapper_on() and compiling.CPP_WRAPPER.holders == 0
        on_cpu = LayerCompiler(True, "cpu")
        on_cpu.open()  # no C++ wrapper for a CPU run
        assert not wrapper_on() and compiling.CPP_WRAPPER.holders == 0
        on_cpu.close()


def test_dynamo_keeps_room_for_the_layers_graph_variants_while_a_run_compiles() -> None:
    """All layers of a class share one graph cache whose variants multiply (grad mode, the input's
    requires_grad, sliding or full attention): dynamo's default of 8 ran GPT-OSS-20B's layers
    eagerly past it on an H100. While a compiling run is open the limit is at least 64 in every
    thread; then what it was, and a run that does not compile changes nothing."""
    import torch._dynamo.config as dynamo_config

    def limit() -> int:
        return int(in_another_thread(lambda: dynamo_config.recompile_limit))

    with compiling.settings_everywhere(dynamo_config, {"recompile_limit": 8}):
        LayerCompiler(False, "cuda").open()
        assert limit() == 8
        first, second = LayerCompiler(True, "cpu"), LayerCompiler(True, "cpu")
        first.open()
        second.open()
        assert limit() == compiling.LAYER_GRAPH_VARIANTS == 64
        first.close()
        assert limit() == 64  # the second run is still open
        second.close()
        assert limit() == 8 and compiling.RECOMPILE_LIMIT.holders == 0
        with compiling.settings_everywhere(dynamo_config, {"recompile_limit": 100}):  # a larger limit stays
            first.open()
            assert limit() == 100
            first.close()
            assert limit() == 100


def test_layers_say_how_they_compile() -> None:
    """Blocks compile their inner layer, the head its loss kernel, the embedding nothing; a
    layer without the hook is compiled only when asked for explicitly."""
    seq = to_layer_sequence(tiny_qwen3())
    calls: list[str] = []

    class Recording(compiling.Compiler):
        def module(self, module: nn.Module) -> None:
            calls.append(type(module).__name__)

        def function(self, fn, **options):  # type: ignore[no-untyped-def]
            calls.append(fn.__name__)
            return fn

    auto = LayerCompiler("auto", "cuda", Recording())
    auto.enabled = True  # as on a machine with triton
    for layer in [*seq.layers, nn.Linear(2, 2)]:
        auto.prepare(layer)
    assert calls == ["Qwen3DecoderLayer", "Qwen3DecoderLayer", "softmax_cross_entropy_grad"]
    calls.clear()
    LayerCompiler(True, "cpu", Recording()).prepare(nn.Linear(2, 2))
    assert calls == ["Linear"]


def test_compiled_training_equals_the_plain_loop(eager_dynamo: None) -> None:
    model = tiny_qwen3()
    reference = copy.deepcopy(model)
    data = token_data(2)
    expected = reference_loop(reference, data)
    losses = pipe_loop(model, data, compile=True)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Two decoder layers on two devices, with and without grad, the loss kernel and the embedding
    # (compile=True compiles it too): graphs are shared between the copies, not one per copy.
    assert 0 < graphs <= 8, graphs


def _activation_shaped(seq: int) -> int:
    count = 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.dim() == 3 and obj.shape[1] == seq:
                count += 1
        except Exception:  # a dead weak proxy
            continue
    return count


@pytest.mark.parametrize("collect", [True, False])
def test_compiling_leaves_no_tensors_in_garbage(
    eager_dynamo: None, monkeypatch: pytest.MonkeyPatch, collect: bool
) -> None:
    """Compiling builds reference cycles that hold the call's real tensors; the runtime collects
    them after the task that compiled, so none wait for the interpreter's next full collection
    (on a GPU those were 2 GiB of activations, and an out-of-memory)."""
    if not collect:  # the same run without the collection: the check below can fail
        monkeypatch.setattr(compiling.CompileGarbage, "collect_if_compiled", lambda self: False)
    seq = 24
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=False, compile=True)
    gc.collect()
    gc.disable()
    try:
        with roundpipe.RoundPipe(tiny_qwen3(), optimizer=sgd, config=config) as pipe:
            pipe.forward_backward(token_data(1, seq=seq)[0], None, None)
            pipe.step()
            pipe.synchronize()
            before = _activation_shaped(seq)
            gc.collect()
            in_garbage = before - _activation_shaped(seq)
    finally:
        gc.enable()
    assert (in_garbage == 0) == collect, in_garbage


def test_layers_with_experts_launch_from_the_cpp_wrapper_through_roundpipes_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every compiled CUDA run holds the C++ wrapper, one with mixture-of-experts layers too, whose
    copies then call their grouped products as ``roundpipe::grouped_mm``: the C++ wrapper cannot
    build torch's own product on torch 2.11, while it calls a registered operator."""
    from roundpipe.model.experts import use_grouped_experts
    from tests.helpers import tiny_causal_lm
    from tests.test_transformers_parity import tiny_qwen3_moe

    monkeypatch.setattr(compiling, "wants_cpp_wrapper", lambda device_type: True)
    wrapped = {}
    for name, model in (("dense", tiny_causal_lm()), ("moe", tiny_qwen3_moe())):
        config = roundpipe.RunConfig(devices="cpu:1", compile=True, num_microbatches=1)
        with roundpipe.RoundPipe(
            model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config=config
        ) as pipe:
            wrapped[name] = pipe.runtime.compiler.cpp_wrapper
    assert wrapped == {"dense": True, "moe": True}
    dispatched = {}
    for wants in (True, False):
        monkeypatch.setattr(compiling, "wants_cpp_wrapper", lambda device_type, wants=wants: wants)
        layer = tiny_qwen3_moe().model.layers[0]
        assert use_grouped_experts(layer) == 1  # what roundpipe's copies of a layer run
        LayerCompiler(True, "cuda").prepare(layer)
        dispatched[wants] = [getattr(m, "dispatch_products", False) for m in layer.modules()].count(True)
    assert dispatched == {True: 1, False: 0}


def test_rotary_tables_leave_the_embedding_contiguous_as_their_uploaded_copies_arrive() -> None:
    """A layer compiled for the tables as they cross the link (dense copies) reads the ones its own
    stage's embedding made in that layout too, not in a second one compiled apart."""
    from roundpipe.model.attention_masks import rotary_tables

    class TransposedTables(nn.Module):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            freqs = torch.arange(2 * 4 * 8.0).reshape(2, 4, 8).transpose(1, 2)  # [2, 8, 4], a view
            return freqs.cos(), freqs.sin().transpose(1, 2).contiguous().transpose(1, 2)

    made = TransposedTables()(torch.zeros(1), torch.zeros(1))
    assert not made[0].is_contiguous() and not made[1].is_contiguous()
    tables = rotary_tables(
        TransposedTables(), torch.zeros(2, 8, 16), torch.arange(8)[None], ["full_attention"]
    )
    assert sorted(tables) == ["_cos", "_sin"]
    for table, original in zip((tables["_cos"], tables["_sin"]), made, strict=True):
        assert table.is_contiguous() and torch.equal(table, original)


def _lora_gpt_oss() -> nn.Module:
    from tests.test_moe_parity import tiny_gpt_oss
    from tests.test_transformers_parity import lora

    return lora(tiny_gpt_oss(layers=6))


def _lora_qwen3() -> nn.Module:
    from tests.helpers import tiny_causal_lm
    from tests.test_transformers_parity import lora

    return lora(tiny_causal_lm("qwen3", vocab=64, attn="sdpa", layers=8))


def _measure_in_fixed_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device profile measures bytes as it does, and gives every layer the same times."""
    measure = profile._measure_layer

    def fixed(*args: Any, **kwargs: Any) -> Any:
        measurement, output = measure(*args, **kwargs)
        return dataclasses.replace(measurement, fwd_ms=1.0, fwd_grad_ms=1.0, bwd_ms=2.0), output

    monkeypatch.setattr(profile, "_measure_layer", fixed)


@pytest.mark.parametrize(
    ("make", "budget", "grain", "graphs"),
    [
        (_lora_gpt_oss, "200KiB", "stage", 8),
        (_lora_qwen3, "300KiB", "stage", 4),
        (_lora_qwen3, "300KiB", "layer_input", 4),
    ],
    ids=["gpt-oss", "qwen3", "qwen3-layer-input"],
)
def test_a_compiled_lora_pipe_builds_only_the_variants_its_stages_run(
    eager_dynamo: None, monkeypatch: pytest.MonkeyPatch, make: Any, budget: str, grain: str, graphs: int
) -> None:
    """LoRA in several stages on one device. GPT-OSS: its decoder layer's graphs are grad mode (2) x
    attention kind (2), the backward stages' last layers' unread tails (2), the first layer after
    the frozen embedding with an input that needs no gradient (1), and one more graph for the
    embedding's stage: 8. Qwen3, one attention kind: 4. Whatever the profile called (its calls
    without grad see the weights as a forward stage binds them) and however often the plan flags a
    tail (before either held: 12, 7 and 6 graphs). A plan whose first layer closes a stage adds one
    more (an unread tail whose input needs no gradient), so the plan is fixed here."""
    import torch._dynamo.config as dynamo_config

    model = make()
    # The count depends on the plan (which layers open or close a stage): planned from fixed times,
    # not the CPU's measured ones, and never re-planned, it is the same plan on every machine.
    _measure_in_fixed_times(monkeypatch)
    options = dict(
        devices="cpu:1", num_microbatches=4, memory_budget=budget, recompute_grain=grain, replan=False
    )
    # Every variant counted: the limit raised in the lane threads too, where the layers compile.
    with compiling.settings_everywhere(dynamo_config, {"recompile_limit": 64}):
        pipe_loop(model, token_data(3, seq=16), compile=True, **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
