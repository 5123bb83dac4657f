"""A whole attention decoder layer sliced over long sequences: the same numbers, memory linear in
tokens with a bounded workspace, users untouched."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from roundpipe.model import chunked_layer, chunked_mlp
from roundpipe.model.chunked_layer import chunk_long_attention_layer
from tests.test_chunked_mlp import trains_like_the_plain_loop
from tests.test_transformers_parity import token_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Slices of 8 tokens from 16 tokens per row on (the MLP's too); records each checkpointed call."""
    for module in (chunked_layer, chunked_mlp):
        monkeypatch.setattr(module, "CHUNK_TOKENS", 8)
        monkeypatch.setattr(module, "MIN_TOKENS", 16)
    calls: list[int] = []
    real = chunked_layer.checkpoint

    def spy(fn: Any, first: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        calls.append(first.shape[-2])
        return real(fn, first, *rest, **kwargs)

    monkeypatch.setattr(chunked_layer, "checkpoint", spy)
    return calls


def _causal_lm(family: str, hidden: int = 64, intermediate: int = 96, lora: bool = True) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    config = config_class(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    if not lora:
        return model
    lora_config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"]
    )
    model = get_peft_model(model, lora_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero adapters, so their gradients reach A
                p.normal_(0.0, 0.1)
    return model.get_base_model()


def _layer_run(layer: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Any:
    x = x.detach().clone().requires_grad_()
    cos, sin = rotary(x, torch.arange(x.shape[1])[None])
    out = layer(x, attention_mask=None, position_embeddings=(cos, sin))
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sliced_layer_equals_the_original(small_slices: list[int], family: str) -> None:
    model = _causal_lm(family)
    layer = model.model.layers[0]
    chunked = copy.deepcopy(layer)
    assert chunk_long_attention_layer(chunked)
    assert chunked.state_dict().keys() == layer.state_dict().keys()
    torch.manual_seed(1)
    x = torch.randn(2, 20, 64, dtype=torch.float64)
    grad = torch.randn_like(x)
    want = _layer_run(layer, model.model.rotary_emb, x, grad)
    got = _layer_run(chunked, model.model.rotary_emb, x, grad)
    assert small_slices == [8, 8, 4] * 2  # parts A and C, each over 8 + 8 + 4 tokens
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    assert got[2].keys() == want[2].keys() and any("lora_A" in n for n in got[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-10, atol=1e-12)
    short = x[:, :10]  # 10 tokens per row: the original forward, nothing sliced
    cos, sin = model.model.rotary_emb(short, torch.arange(10)[None])
    with torch.no_grad():
        torch.testing.assert_close(
            chunked(short, position_embeddings=(cos, sin)), layer(short, position_embeddings=(cos, sin))
        )
    assert len(small_slices) == 6


def test_layers_it_cannot_reproduce_are_left_alone() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert not chunk_long_attention_layer(eager.model.layers[0])  # eager attention builds an n x n mask
    assert type(eager.model.layers[0]).__name__ == "LlamaDecoderLayer"
    assert not chunk_long_attention_layer(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_through_sliced_replicas_equals_the_plain_loop(
    small_slices: list[int], compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the layers compiled: the slicing is a graph break for long inputs only."""
    from tests.test_transformers_parity import tiny_llama

    data = token_data(2, batch=4, seq=24)  # 24 tokens per row: sliced 8 + 8 + 8
    model = trains_like_the_plain_loop(tiny_llama, data, small_slices, compiled, monkeypatch)
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)


def _ledger_class() -> Any:
    """bench/long_context_memory.py's `Ledger`: the one CPU stand-in for the CUDA allocator's
    ``memory_allocated`` / ``max_memory_allocated`` that the bench and this test share."""
    path = Path(__file__).resolve().parents[1] / "bench" / "long_context_memory.py"
    spec = importlib.util.spec_from_file_location("long_context_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Ledger


Ledger = _ledger_class()


def layer_peak_bytes(layer: torch.nn.Module, rotary: torch.nn.Module, tokens: int, hidden: int) -> int:
    """Peak bytes a layer's forward with grad and backward allocate on one row of ``tokens``
    (beyond its input and the output's gradient): what the profile's working sets measure."""
    torch.manual_seed(2)
    x = torch.randn(1, tokens, hidden, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(1, tokens, hidden)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(tokens)[None])
    with Ledger([x, grad, cos, sin, *layer.parameters()]) as live:
        layer(x, attention_mask=None, position_embeddings=(cos, sin)).backward(grad)
    return live.peak


def test_layer_memory_is_linear_in_tokens_with_a_bounded_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced, a layer's peak grows by a fixed number of bytes per token (about 9 hidden-sized
    values: input, q/k/v, attention output and their gradients) above a workspace that stays that
    of one slice; the original layer's grows three times faster (norm upcasts, LoRA sums, rotary
    products, the MLP's intermediates: everything per token is kept or alive at once)."""
    for module in (chunked_layer, chunked_mlp):
        monkeypatch.setattr(module, "CHUNK_TOKENS", 32)
        monkeypatch.setattr(module, "MIN_TOKENS", 64)
    hidden = 64
    model = _causal_lm("llama", hidden=hidden, intermediate=224).float()
    layer = model.model.layers[0]
    chunked = copy.deepcopy(layer)
    chunk_long_attention_layer(chunked)
    rotary = model.model.rotary_emb
    tokens = (512, 1024, 2048)
    sliced = [layer_peak_bytes(chunked, rotary, n, hidden) for n in tokens]
    plain = [layer_peak_bytes(layer, rotary, n, hidden) for n in tokens]
    per_element = [(sliced[i + 1] - sliced[i]) / ((tokens[i + 1] - tokens[i]) * hidden * 4) for i in range(2)]
    assert per_element[1] == pytest.approx(per_element[0], rel=0.05)  # linear
    assert per_element[1] < 8.5  # fp32 values per hidden element
    workspace = sliced[-1] - per_element[1] * tokens[-1] * hidden * 4
    assert workspace < 32 * 224 * 4 * 8  # a few of one slice's MLP intermediates
    plain_slope = (plain[-1] - plain[-2]) / ((tokens[-1] - tokens[-2]) * hidden * 4)
    assert plain_slope > 2.5 * per_element[1]


def budget_run(model: Any, data: list[dict[str, torch.Tensor]]) -> tuple[list[float], dict[str, Any]]:
    """The pipe's losses over ``data`` under a 4 GiB budget (sync, fp32, cpu:2), and its trace's meta."""
    from tests.test_transformers_parity import pipe_loop

    meta: dict[str, Any] = {}
    return pipe_loop(model, data, meta=meta, memory_budget="4GiB"), meta


def test_under_a_budget_long_rows_run_whole_when_a_plan_fits(small_slices: list[int]) -> None:
    """Slicing computes parts of a layer again, eagerly: with a budget that whole rows fit, the
    copies never slice, and the losses and weights are the plain loop's."""
    from tests.test_transformers_parity import assert_same_weights, reference_loop, tiny_llama

    data = token_data(2, batch=4, seq=24)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    expected = reference_loop(reference, data)
    losses, meta = budget_run(model, data)
    assert not small_slices, "rows that fit whole were sliced"
    assert meta["long_row_slicing"] == "whole"
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)


@pytest.mark.parametrize("fitting", ["modules", "layers"])
def test_under_a_budget_long_rows_take_the_least_slicing_a_plan_fits(
    fitting: str, small_slices: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Levels that no plan fits (the planner raising) are measured and left in order, whole rows,
    then the per-token modules sliced, then whole layers; the run trains at the first that fits,
    to the plain loop's numbers. A budget too small for every level is the last level's error."""
    from roundpipe.errors import PlanError
    from roundpipe.planning.replan import RunPlanner
    from tests.test_transformers_parity import assert_same_weights, reference_loop, tiny_llama

    real, mlp_checkpoint = RunPlanner.profile, chunked_mlp.checkpoint
    measured: list[str] = []
    mlp_slices: list[int] = []

    def profile(self: Any, *args: Any, prepare: Any = None, **options: Any) -> Any:
        level = prepare.__self__.compiler.slicing.level  # the run's Runtime.prepare_replica
        measured.append(level)
        if level != fitting:
            raise PlanError(f"no plan fits the memory budget ({level})")
        return real(self, *args, prepare=prepare, **options)

    def mlp_spy(fn: Any, first: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        mlp_slices.append(first.shape[0])
        return mlp_checkpoint(fn, first, *rest, **kwargs)

    monkeypatch.setattr(RunPlanner, "profile", profile)
    monkeypatch.setattr(chunked_mlp, "checkpoint", mlp_spy)
    data = token_data(2, batch=4, seq=24)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    expected = reference_loop(reference, data)
    losses, meta = budget_run(model, data)
    assert measured == list(chunked_mlp.SLICING_LEVELS[: chunked_mlp.SLICING_LEVELS.index(fitting) + 1])
    assert meta["long_row_slicing"] == fitting
    if fitting == "modules":  # the MLPs slice (48 tokens a call), the layers do not
        assert mlp_slices and not small_slices
    else:  # the layers slice (8-token slices: their MLPs no longer need to)
        assert small_slices
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)

    def never_fits(self: Any, *args: Any, prepare: Any = None, **options: Any) -> Any:
        raise PlanError(f"no plan fits ({prepare.__self__.compiler.slicing.level})")

    monkeypatch.setattr(RunPlanner, "profile", never_fits)
    with pytest.raises(PlanError, match="layers"):
        budget_run(tiny_llama(), data)


def test_the_switch_reaches_every_sliced_module_and_short_rows_never_ask() -> None:
    """`attach_slicing` hands one switch to the sliced MLPs and layers of a copy; each slices at
    the levels that take in its kind; `long_rows` counts a microbatch's tokens."""
    from roundpipe.model.chunked_mlp import LongRowSlicing, attach_slicing, long_rows, slicing_on
    from tests.test_transformers_parity import tiny_llama

    block = copy.deepcopy(tiny_llama().model.layers[0])
    chunk_long_attention_layer(block)
    chunked_mlp.chunk_long_sequences(block.mlp)
    switch = LongRowSlicing(level="whole")
    assert attach_slicing(block, switch) == 2
    assert not slicing_on(block) and not slicing_on(block.mlp)
    switch.level = "modules"
    assert not slicing_on(block) and slicing_on(block.mlp)
    switch.level = "layers"
    assert slicing_on(block) and slicing_on(block.mlp)
    assert slicing_on(torch.nn.Linear(2, 2))  # no switch: slices, as before
    long = chunked_mlp.MIN_TOKENS
    assert long_rows({"input_ids": torch.zeros(1, long, dtype=torch.long)})
    assert long_rows({"input_ids": torch.zeros(2, long // 2, dtype=torch.long)})  # the MLP's count
    assert not long_rows({"input_ids": torch.zeros(1, long - 1, dtype=torch.long)})
    assert long_rows([torch.zeros(1, long, 8)]) and not long_rows(torch.zeros(long))
