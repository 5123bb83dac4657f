"""A recompute that leaves out a layer's frozen tail product gives the same gradients, bit for bit,
and a pipeline that does it trains exactly as one that computes the product."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe.model import frozen_tail
from roundpipe.model.frozen_tail import mark_tail, tails, unread_tail
from roundpipe.model.quant import NF4Linear, quantize_frozen_
from tests.helpers import tiny_causal_lm
from tests.test_transformers_parity import VOCAB, lora, pipe_loop, tiny_qwen3_moe, token_data


def decoder_layer(targets: tuple[str, ...] = ("q_proj", "v_proj"), kind: str = "qwen3") -> nn.Module:
    model = lora(tiny_causal_lm(kind, vocab=VOCAB, attn="sdpa"), targets)
    layer: nn.Module = model.get_submodule("base_model.model.model.layers.0")
    return layer


def grads_of(layer: nn.Module, skip: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """The input's and every trainable parameter's gradient of one call of ``layer``."""
    g = torch.Generator().manual_seed(seed)
    hidden = layer.self_attn.config.hidden_size
    x = torch.randn(2, 8, hidden, generator=g, requires_grad=True)
    head_dim = layer.self_attn.head_dim
    cos, sin = torch.ones(2, 8, head_dim), torch.zeros(2, 8, head_dim)
    grad = torch.randn(2, 8, hidden, generator=g)
    layer.zero_grad()
    with unread_tail(tails(layer)) if skip else torch.enable_grad():
        out = layer(x, position_embeddings=(cos, sin))
    out.backward(grad)
    found = {"input": x.grad.clone()}
    found |= {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return found


def assert_same_grads(layer: nn.Module) -> None:
    full, skipped = grads_of(layer, skip=False), grads_of(layer, skip=True)
    assert full.keys() == skipped.keys() and len(full) > 1
    for name in full:
        assert torch.equal(full[name], skipped[name]), name


def counting_skips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = frozen_tail._unread_output

    def counted(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(module, x)

    monkeypatch.setattr(frozen_tail, "_unread_output", counted)
    return calls


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_skipped_tail_leaves_every_gradient_as_the_full_call_gives(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = decoder_layer(kind=kind)
    assert mark_tail(layer) and tails(layer) == [layer.mlp.down_proj]
    skips = counting_skips(monkeypatch)
    assert_same_grads(layer)
    assert len(skips) == 1  # only the skipping call, and it did skip


def test_lora_on_the_tail_keeps_its_adapter_and_skips_only_the_frozen_base() -> None:
    layer = decoder_layer(("q_proj", "down_proj"))
    assert mark_tail(layer)
    assert tails(layer) == [layer.mlp.down_proj.base_layer]
    assert_same_grads(layer)  # down_proj's lora_A and lora_B among them


@pytest.mark.parametrize("dense", [False, True], ids=["per-call", "run-copy-bound"])
def test_a_4_bit_tail_skips_and_dequantizes_for_the_backward(dense: bool) -> None:
    layer = decoder_layer()
    quantize_frozen_(layer)
    down = (
        layer.mlp.down_proj.base_layer if hasattr(layer.mlp.down_proj, "base_layer") else layer.mlp.down_proj
    )
    assert isinstance(down, NF4Linear)
    if dense:
        down.dense = nn.Parameter(down.dequantized(torch.float32), requires_grad=False)
    assert mark_tail(layer)
    assert_same_grads(layer)


def test_dora_on_the_tail_keeps_the_product_its_magnitude_reads() -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], use_dora=True)
    model: Any = get_peft_model(tiny_causal_lm("qwen3", vocab=VOCAB, attn="sdpa"), config)
    assert not mark_tail(model.get_submodule("base_model.model.model.layers.0"))


def test_a_training_tail_a_moe_layer_and_no_grad_keep_the_product() -> None:
    full = lora(tiny_causal_lm("qwen3", vocab=VOCAB), ("q_proj",))
    for p in full.parameters():
        p.requires_grad_(True)  # a full fine-tune: down_proj's weight needs its input
    assert not mark_tail(full.get_submodule("base_model.model.model.layers.0"))
    moe: Any = tiny_qwen3_moe()
    assert not mark_tail(moe.model.layers[0])
    layer = decoder_layer()
    mark_tail(layer)
    x = torch.randn(1, 4, layer.self_attn.config.hidden_size)
    ones = torch.ones(1, 4, layer.self_attn.head_dim)
    with torch.no_grad(), unread_tail(tails(layer)):  # a forward stage's call: the value is read
        skipped = layer(x, position_embeddings=(ones, 0 * ones))
    with torch.no_grad():
        assert torch.equal(skipped, layer(x, position_embeddings=(ones, 0 * ones)))


def test_the_flag_is_per_copy_and_off_after_the_call() -> None:
    layer = decoder_layer()
    mark_tail(layer)
    other = copy.deepcopy(layer)
    with unread_tail(tails(layer)):
        assert tails(layer)[0].output_unread and not tails(other)[0].output_unread
    assert not tails(layer)[0].output_unread


def four_block_lora() -> nn.Module:
    model = tiny_causal_lm("qwen3", vocab=VOCAB, attn="sdpa", layers=4)
    return lora(model, ("q_proj", "v_proj", "o_proj"))


Trained = tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]


def trained_on_one_worker(
    model: nn.Module, grain: str, skip: bool, microbatches: int, budget: str, residuals: bool = False
) -> Trained:
    """Losses, trained weights and the trace's meta of two steps of ``model`` on one CPU worker
    under a ``budget`` that splits off backward stages, in the coarse plan (`coarse_plans`);
    ``residuals``: layer_input recomputes take the saved post-attention residuals
    (`roundpipe.model.attention_residual`)."""
    options: dict[str, Any] = dict(
        num_microbatches=microbatches,
        memory_budget=budget,
        replan=False,
        devices="cpu:1",
        save_residuals=residuals,
    )
    meta: dict[str, Any] = {}
    with coarse_plans():
        losses = pipe_loop(
            model, token_data(2), meta, skip_unread_tail=skip, recompute_grain=grain, **options
        )
    assert meta["plan"]["bwd_stages"], "the budget no longer splits off a backward stage"
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, meta


def trained(grain: str, skip: bool, residuals: bool = False) -> Trained:
    """The four-block model (layer 0 is the embedding, 1-4 the blocks, 5 the head)."""
    return trained_on_one_worker(four_block_lora(), grain, skip, 4, "256KiB", residuals)


@contextmanager
def coarse_plans() -> Iterator[None]:
    """The one-device plan of the fewest stages that fit, always: otherwise a plan from measured
    times with as few slots wins, and those times (so its stages) change with the machine's load."""
    from roundpipe.planning import device_plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_plan, "BACKWARD_STAGE_LAYERS", 1 << 20)  # no cap, but the coarse plan
        yield


def skipping_recomputes(meta: dict[str, Any], grain: str, steps: int, microbatches: int) -> int:
    """How many layer recomputes of a run leave out their tail: each backward stage's last layer,
    or with layer or layer_input grain every layer of it; the embedding (layer 0) has none."""
    stages = [range(*r) for r in meta["plan"]["bwd_stages"]]
    ends = [[r.stop - 1] if grain == "stage" else list(r) for r in stages]
    return steps * microbatches * sum(1 for layers in ends for j in layers if j > 0)


@pytest.mark.parametrize(
    ("grain", "residuals"),
    [("stage", False), ("layer", False), ("layer_input", False), ("layer_input", True)],
    ids=["stage", "layer", "layer_input", "layer_input-residuals"],
)
def test_a_pipeline_that_skips_trains_exactly_as_one_that_computes_the_tail(
    grain: str, residuals: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the residuals saved, each skipping recompute also leaves out ``o_proj``; the residual
    comes from the forward without grad (whose attention kernel may differ from the recompute's),
    so the weights agree to rounding there, bit for bit elsewhere."""
    skips = counting_skips(monkeypatch)
    losses, adapters, meta = trained(grain, skip=True, residuals=residuals)
    assert meta["layer_residuals"] is residuals  # the trace says whether the plan saved them
    skipped_per_recompute = 2 if residuals else 1
    recomputes = skipping_recomputes(meta, grain, steps=2, microbatches=4)
    assert len(skips) == skipped_per_recompute * recomputes > 0
    skips.clear()
    expected_losses, expected, _ = trained(grain, skip=False)
    assert not skips
    assert losses == expected_losses
    assert adapters.keys() == expected.keys()
    for name in expected:
        if residuals:
            torch.testing.assert_close(adapters[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert torch.equal(adapters[name], expected[name]), name


def test_layer_grain_recomputes_a_stage_without_gradients_up_to_its_last_layer_only() -> None:
    """A backward stage at layer grain needs every layer's input, not its last output: its pass
    without gradients stops before its last layer, so against stage grain (one recompute with
    gradients, then the backward) it calls each stage's layers but the last once more."""

    def counted_run(grain: str) -> tuple[int, list[range]]:
        model, calls = four_block_lora(), [0]
        for block in model.get_submodule("base_model.model.model.layers"):
            block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        # A budget where both grains plan the same stages, one of two layers (272-288 KiB here).
        _, _, meta = trained_on_one_worker(model, grain, True, microbatches=4, budget="288KiB")
        return calls[0], [range(*r) for r in meta["plan"]["bwd_stages"]]

    stage_calls, stage_stages = counted_run("stage")
    calls, stages = counted_run("layer")
    assert stages == stage_stages and max(len(r) for r in stages) > 1  # a stage on the layer-grain path
    blocks = range(1, 5)  # layer 0 is the embedding, 5 the head
    once_more = sum(j in blocks for r in stages for j in r[:-1])
    assert calls - stage_calls == 2 * 4 * once_more > 0  # two steps of four microbatches


def test_every_layer_from_its_saved_input_trains_as_the_stage_recompute() -> None:
    losses, adapters, meta = trained("layer_input", skip=True)
    assert any(len(range(*r)) > 1 for r in meta["plan"]["bwd_stages"])  # a stage of several inputs
    stage_losses, stage_adapters, _ = trained("stage", skip=True)
    assert losses == pytest.approx(stage_losses, rel=1e-6)
    for name in stage_adapters:
        torch.testing.assert_close(adapters[name], stage_adapters[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4-per-call"])
def test_a_compiled_layer_skips_in_its_own_graph_and_keeps_the_gradients(nf4: bool) -> None:
    torch._dynamo.reset()
    layer = decoder_layer()
    if nf4:
        quantize_frozen_(layer)
    mark_tail(layer)
    layer.compile(backend="aot_eager")  # traces the skip's autograd function like inductor does
    full, skipped, again = (
        grads_of(layer, skip=False),
        grads_of(layer, skip=True),
        grads_of(layer, skip=False),
    )
    for name in full:
        assert torch.equal(full[name], skipped[name]) and torch.equal(full[name], again[name]), name
    x = torch.randn(1, 4, layer.self_attn.config.hidden_size, requires_grad=True)
    ones = torch.ones(1, 4, layer.self_attn.head_dim)
    with unread_tail(tails(layer)):
        out = layer(x, position_embeddings=(ones, 0 * ones))
    # The compiled graph honoured the flag: its output lacks the MLP's sum, its gradients do not.
    assert not torch.equal(out, layer(x, position_embeddings=(ones, 0 * ones)))
    torch._dynamo.reset()


def test_a_compiled_tail_set_back_after_a_skip_runs_the_code_compiled_before_it() -> None:
    """The flag is the copy's own from marking on, so dynamo's guard reads one value before and
    after a skip: a layer whose tail a plan skips once compiles no third variant."""
    torch._dynamo.reset()
    layer = decoder_layer()
    mark_tail(layer)
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    layer.compile(backend=counting)
    grads_of(layer, skip=False)
    grads_of(layer, skip=True)
    compiled = len(graphs)
    grads_of(layer, skip=False)
    grads_of(copy.deepcopy(layer), skip=False)  # a copy made after the skip matches too
    assert compiled > 0 and len(graphs) == compiled
    torch._dynamo.reset()


def test_with_every_layer_input_a_backward_upload_waits_for_the_deepest_saver_and_counts_all() -> None:
    from roundpipe.plan import Plan
    from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions
    from roundpipe.sched.keys import ActDownKey, ActUpKey

    # Forward slots 0: [0, 2), 1: [2, 4); fused slot 2: [4, 6); backward slot 3: [1, 4), 4: [0, 1).
    plan = Plan((range(0, 2), range(2, 4)), range(4, 6), (range(1, 4), range(0, 1)), 1.0, 1, 1)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    for every, (saver, nbytes) in ((False, (0, 100)), (True, (1, 300))):
        builder = GraphBuilder(plan, spec, 1, ScheduleOptions(layer_inputs=every))
        tasks = {t.key: t for t in builder.forward_backward(0, 0, 1).tasks}
        upload = tasks[ActUpKey(0, 3, 0)]
        # Layer 1's input is saved by slot 0; layers 2 and 3's by slot 1, which runs after it.
        assert ActDownKey(0, saver, 0) in upload.deps and upload.nbytes == nbytes


@pytest.mark.parametrize("whole_layer", [False, True], ids=["sliced-mlp", "sliced-layer"])
def test_a_long_rows_sliced_path_computes_the_tail_its_checkpoints_recompute(
    whole_layer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roundpipe.model import chunked_layer, chunked_mlp

    for module in (chunked_layer, chunked_mlp):
        monkeypatch.setattr(module, "CHUNK_TOKENS", 4)
        monkeypatch.setattr(module, "MIN_TOKENS", 8)  # grads_of's rows are 8 tokens long
    layer = decoder_layer()
    if whole_layer:
        assert chunked_layer.chunk_long_attention_layer(layer)
    else:
        chunked_mlp.chunk_long_sequences(layer.mlp)
    mark_tail(layer)
    skips = counting_skips(monkeypatch)
    assert_same_grads(layer)
    assert not skips and not tails(layer)[0].output_unread


def test_with_residuals_a_backward_upload_waits_for_the_slot_computing_its_deepest_layer() -> None:
    """Layer 2 opens forward slot 1, so slot 0 saves its input, but slot 1 computes its residual:
    the backward stage [1, 3) waits for slot 1's download, and brings two tensors a layer."""
    from roundpipe.plan import Plan
    from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions
    from roundpipe.sched.keys import ActDownKey, ActUpKey

    plan = Plan((range(0, 2), range(2, 4)), range(4, 6), (range(3, 4), range(1, 3), range(0, 1)), 1.0, 1, 1)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    for residuals, (saver, nbytes) in ((False, (0, 200)), (True, (1, 400))):
        options = ScheduleOptions(layer_inputs=True, layer_residuals=residuals)
        tasks = {t.key: t for t in GraphBuilder(plan, spec, 1, options).forward_backward(0, 0, 1).tasks}
        upload = tasks[ActUpKey(0, 4, 0)]  # slots: fwd 0, 1, fused 2, bwd 3 ([3, 4)), 4 ([1, 3))
        assert ActDownKey(0, saver, 0) in upload.deps and upload.nbytes == nbytes
