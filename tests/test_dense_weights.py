"""4-bit weights dequantized once per stage run: the same numbers as per call, far fewer
dequantizations, nothing kept past the run, and a memory model and planner that count the copies."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.model import expert_products
from roundpipe.model.dense_weights import add_dense_slots, dense_bytes, dequantize_run, quantized_sublayers
from roundpipe.model.quant import NF4Linear, quantize_frozen_
from roundpipe.plan.layer_memory import LayerMemory
from roundpipe.plan.memory import layer_plan_bytes, stage_bytes
from roundpipe.planning.dequantize import plan_dequantizing
from tests.test_moe_experts import IDS, MODELS, eager, qkvo_lora
from tests.test_moe_parity import padded_data
from tests.test_quant_pipe import adapters, lora_qwen3
from tests.test_transformers_parity import pipe_loop, sgd, token_data


def test_a_bound_dense_copy_gives_the_per_call_numbers() -> None:
    torch.manual_seed(0)
    layer = NF4Linear.from_linear(nn.Linear(128, 64, bias=True).requires_grad_(False))
    replica = copy.deepcopy(layer)
    add_dense_slots(replica)
    params = dict(layer.named_parameters())
    (sub,) = quantized_sublayers(layer)
    dense = dequantize_run((sub,), params, torch.float32)
    assert list(dense) == ["dense"] and dense["dense"].shape == (64, 128)
    replica._parameters["dense"] = dense["dense"]  # as the runtime's binder does
    x = torch.randn(5, 128, requires_grad=True)
    y = torch.randn(5, 128, requires_grad=True)
    with torch.no_grad():
        x2 = x.clone().requires_grad_()
    layer(x).square().sum().backward()
    replica(x2).square().sum().backward()
    assert torch.equal(layer(y), replica(y))
    assert x.grad is not None and x2.grad is not None and torch.equal(x.grad, x2.grad)
    assert dense_bytes(layer, torch.bfloat16) == 64 * 128 * 2
    assert dense_bytes(nn.Linear(4, 4), torch.bfloat16) == 0


def counted_run(
    dequantize: str,
    monkeypatch: pytest.MonkeyPatch,
    grain: str = "stage",
    per_call: frozenset[int] = frozenset(),
) -> tuple[list[float], Any, int, int]:
    """Losses, adapters, dequantizations and the most dense copies held at once over two steps
    (``per_call``: layers that dequantize in each call while runs hold copies of the others')."""
    calls = {"n": 0, "held": 0}
    real = expert_products.dequantize_nf4

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        return real(*args, **kwargs)

    # A run's copies (`dense_weights.dequantize_run`, through `expert_products.dense_weight`) and the
    # per-call path of `NF4Linear`.
    monkeypatch.setattr(expert_products, "dequantize_nf4", counting)
    monkeypatch.setattr(roundpipe.model.quant, "dequantize_nf4", counting)
    model = lora_qwen3()
    config = roundpipe.RunConfig(
        devices="cpu:1",
        num_microbatches=3,
        round_size=3,  # one stage run carries all three microbatches
        async_optimizer=False,
        base_format="nf4",
        dequantize=dequantize,
        recompute_grain=grain,
    )
    losses = []
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        pipe.runtime.dense.per_call = per_call
        runs = pipe.runtime.dense.runs
        drop = pipe.runtime.dense.drop

        def watching(task: Any) -> None:
            calls["held"] = max(calls["held"], len(runs))
            copied = {
                layer
                for held in runs.values()
                for layer, named in held.items()
                if any("dense" in n for n in named)
            }
            assert not copied & per_call, "a layer left per call got a run's copy"
            drop(task)

        pipe.runtime.dense.drop = watching  # type: ignore[method-assign]
        for batch in token_data(2):
            losses.append(pipe.forward_backward(batch, None, None))
            pipe.step()
        pipe.synchronize()
        assert not runs  # every run's copies went with its last compute
        expected = per_run_dequantizations(list(pipe.trace()), len(pipe.host.layers))
    if dequantize == "run" and not per_call:
        assert calls["n"] == expected
    return losses, adapters(model), calls["n"], calls["held"]


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_nf4_experts_once_per_run_train_as_per_call(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frozen experts held in NF4 get dense slots too (one per 3-D weight): the grouped products
    then run on the run's dense copies, with the per-call numbers."""
    products = {"n": 0}
    product = expert_products._NF4GroupedMM.apply

    def counting(*args: Any) -> torch.Tensor:
        products["n"] += 1  # a grouped product that dequantized its weight itself
        out: torch.Tensor = product(*args)
        return out

    monkeypatch.setattr(expert_products._NF4GroupedMM, "apply", counting)
    results, per_call = [], []
    for dequantize in ("run", "call"):
        products["n"] = 0
        model: Any = qkvo_lora(eager(make(router_logits=True)))
        results.append(
            trained(
                model,
                padded_data(2),
                devices="cpu:1",
                num_microbatches=2,
                round_size=2,
                dequantize=dequantize,
            )
        )
        per_call.append(products["n"])
    assert per_call[0] < per_call[1] // 2  # once a run, the products took the bound copies
    quantized = quantize_frozen_(qkvo_lora(eager(make(router_logits=True))))
    block = next(m for m in quantized.modules() if type(m).__name__.endswith("DecoderLayer"))
    slots = [sub.slot for sub in quantized_sublayers(block)]
    experts = [slot for slot in slots if "experts" in slot]
    assert sorted(s.rsplit(".", 1)[1] for s in experts) == ["down_proj_dense", "gate_up_proj_dense"]
    assert len(slots) == 6  # q, k, v, o and the experts' two weights
    (run_losses, run_adapters), (call_losses, call_adapters) = results
    assert run_losses == call_losses
    for name, tensor in call_adapters.items():
        assert torch.equal(run_adapters[name], tensor), name


def trained(model: nn.Module, data: list[dict[str, torch.Tensor]], **fields: Any) -> tuple[list[float], Any]:
    """Losses and adapters after a synchronous step per batch with a 4-bit base."""
    return pipe_loop(model, data, base_format="nf4", **fields), adapters(model)


def per_run_dequantizations(tasks: list[Any], num_layers: int) -> int:
    """7 quantized linears in each decoder block (layers 1 to n-2), each dequantized once a run."""
    blocks = range(1, num_layers - 1)
    runs = {
        (task.device, task.iteration, task.round, task.slot, sum(layer in blocks for layer in task.layers))
        for task in tasks
        if task.kind in ("compute", "recompute")
    }
    return 7 * sum(run[-1] for run in runs)


@pytest.mark.parametrize("grain", ["stage", "layer", "layer_input"])
def test_once_per_run_trains_as_per_call_with_fewer_dequantizations(
    monkeypatch: pytest.MonkeyPatch, grain: str
) -> None:
    per_call, want, calls, held = counted_run("call", monkeypatch, grain)
    per_run, got, runs, held_per_run = counted_run("run", monkeypatch, grain)
    assert per_run == per_call
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert calls >= 3 * runs  # per call, each of a run's three microbatches dequantizes at least once
    assert held == 0 and held_per_run == 1  # one run's copies at a time on the one device


def test_layers_left_per_call_dequantize_in_each_call_beside_runs_holding_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plan may leave its fused stage per call (`roundpipe.planning.even_stages`): those layers
    take no copies, the other runs keep theirs, and the numbers are the per-call ones."""
    per_call, want, calls, _ = counted_run("call", monkeypatch)
    _, _, runs, _ = counted_run("run", monkeypatch)
    mixed, got, mixed_calls, held = counted_run("run", monkeypatch, per_call=frozenset((2,)))
    assert mixed == per_call
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert runs < mixed_calls < calls and held == 1


def table(dense: tuple[int, ...] = ()) -> LayerMemory:
    n = 4
    return LayerMemory(
        param_bytes=(100,) * n,
        grad_bytes=(1,) * n,
        saved_bytes=(10,) * n,
        work_bytes=(5,) * n,
        boundary_bytes=(2,) * n,
        dense_bytes=dense,
    )


def test_the_memory_model_counts_a_stage_runs_dense_copies() -> None:
    plain, dense = table(), table((400,) * 4)
    for kind in ("fwd", "fused", "bwd"):
        assert stage_bytes(dense, range(1, 3), kind) == stage_bytes(plain, range(1, 3), kind) + 800  # type: ignore[arg-type]
    assert [a - b for a, b in zip(layer_plan_bytes(dense), layer_plan_bytes(plain), strict=True)] == [400] * 4
    assert dense.scaled(2.0).dense_bytes == dense.dense_bytes  # weights do not scale with tokens
    with pytest.raises(roundpipe.PlanError, match="dense_bytes"):
        table((1, 2, 3))


def test_a_run_makes_its_copies_only_once_the_run_before_has_dropped_its_own() -> None:
    """A forward run's first microbatch may compute before the last of the run before on its
    device: it then dequantizes in its calls, and the run's copies come with its next compute."""
    from roundpipe.backends.dense_runs import DenseRuns
    from roundpipe.backends.host_data import RunKey
    from roundpipe.sched.task import COMPUTE, Task

    layer = quantize_frozen_(nn.Sequential(nn.Linear(64, 64).requires_grad_(False)))
    runs = DenseRuns([layer], torch.float32)
    runs.enabled = True
    weights: dict[int, dict[str, torch.Tensor]] = {0: dict(layer.named_parameters())}
    first, second, elsewhere = RunKey(0, 0, 0, 0), RunKey(0, 0, 0, 1), RunKey(1, 0, 0, 1)
    transient = {first: weights, second: weights, elsewhere: weights}
    assert "0.dense" in runs.params(first, transient)[0]
    assert runs.params(second, transient) is weights  # the run before still holds its copies
    assert "0.dense" in runs.params(elsewhere, transient)[0]  # another device
    of_first = {"device": 0, "iteration": 0, "round": 0, "slot": 0, "num_parts": 2}
    runs.drop(Task(("c", 1), COMPUTE, "compute0", part=0, **of_first))  # not its last compute
    assert first in runs.runs
    runs.drop(Task(("c", 0), COMPUTE, "compute0", part=1, **of_first))
    assert "0.dense" in runs.params(second, transient)[0]
    assert set(runs.runs) == {second, elsewhere}


def test_a_run_left_per_call_makes_no_copies_and_the_next_run_waits_for_its_end() -> None:
    """A fused run left per call holds no copies, yet the run after it makes its own only once the
    fused run's last compute is done: never beside the fused stage's activations."""
    from roundpipe.backends.dense_runs import DenseRuns
    from roundpipe.backends.host_data import RunKey
    from roundpipe.sched.task import COMPUTE, Task

    layers = [quantize_frozen_(nn.Sequential(nn.Linear(64, 64).requires_grad_(False))) for _ in range(2)]
    runs = DenseRuns(layers, torch.float32)
    runs.enabled, runs.per_call = True, frozenset((1,))
    fused, after = RunKey(0, 0, 0, 0), RunKey(0, 0, 0, 1)
    transient = {
        fused: {1: dict(layers[1].named_parameters())},
        after: {0: dict(layers[0].named_parameters())},
    }
    assert runs.params(fused, transient)[1] is transient[fused][1]  # no copy
    assert runs.per_call_layers() == [1]
    assert runs.params(after, transient) is transient[after]  # the fused run has not ended
    of_fused = {"device": 0, "iteration": 0, "round": 0, "slot": 0, "num_parts": 1}
    runs.drop(Task(("c", 0), COMPUTE, "compute0", part=0, **of_fused))
    assert "0.dense" in runs.params(after, transient)[0]


def test_auto_falls_back_to_per_call_where_no_plan_fits_the_copies() -> None:
    layers = [quantize_frozen_(nn.Sequential(nn.Linear(64, 64).requires_grad_(False))) for _ in range(4)]
    seen: list[tuple[int, ...]] = []

    def plan_with(limit: int) -> Any:
        def plan(mem: LayerMemory) -> tuple[int, ...]:
            seen.append(mem.dense_bytes)
            if sum(mem.dense_bytes) > limit:
                raise roundpipe.PlanError("no plan fits")
            return mem.dense_bytes

        return plan

    def choose(mode: str, limit: int) -> tuple[int, ...]:
        config = roundpipe.RunConfig(devices="cpu:1", dequantize=mode)
        return plan_dequantizing(config, table(), plan_with(limit), layers, torch.bfloat16)

    assert choose("auto", 10**9) == (64 * 64 * 2,) * 4
    assert choose("auto", 0) == (0,) * 4
    assert choose("call", 10**9) == (0,) * 4
    one = roundpipe.RunConfig(devices="cpu:1", num_microbatches=1)  # a run of one microbatch
    assert plan_dequantizing(one, table(), plan_with(10**9), layers, torch.bfloat16) == (0,) * 4
    with pytest.raises(roundpipe.PlanError, match="dequantize='call'"):
        choose("run", 0)


def test_the_train_command_passes_dequantize_through() -> None:
    import argparse

    from roundpipe.cli.train_command import add_parser, options
    from roundpipe.train.config import TrainConfig, make_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--lora-r", "4", "--base-format", "nf4", "--dequantize", "call"])
    assert options(args)["dequantize"] == "call"
    assert make_config(options(args)).run_config().dequantize == "call"
    assert TrainConfig().run_config().dequantize == "auto"
    with pytest.raises(roundpipe.ConfigError, match="dequantize"):
        make_config({"dequantize": "never"})


@pytest.mark.gpu
def test_once_per_run_on_cuda_trains_as_per_call() -> None:
    """On cuda:0, compiled layers, bf16: the same losses and adapters dequantizing once per run as
    in each call (the dense copy and the per-call weight are the same bits; the products are the
    same products)."""
    results = []
    for dequantize in ("run", "call"):
        fields = dict(devices="cuda:0", num_microbatches=3, precision="bf16", compile=True)
        results.append(trained(lora_qwen3(), token_data(3), dequantize=dequantize, **fields))
    (run_losses, run_adapters), (call_losses, call_adapters) = results
    assert run_losses == pytest.approx(call_losses, rel=1e-2, abs=1e-2)
    for name, tensor in call_adapters.items():
        torch.testing.assert_close(run_adapters[name], tensor, rtol=2e-2, atol=2e-3, msg=name)


def test_a_device_plan_hands_the_layers_left_per_call_to_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime reads which layers dequantize in each call from the device plan's memory table
    (`roundpipe.plan_meta`), and the trace names them; the numbers stay the per-call ones."""
    monkeypatch.setattr("roundpipe.plan_meta.per_call_layers_of", lambda memory: frozenset((2,)))
    runs = []
    for dequantize in ("run", "call"):
        meta: dict[str, Any] = {}
        fields = dict(devices="cpu:1", num_microbatches=3, memory_budget="4GiB")
        losses = pipe_loop(
            lora_qwen3(), token_data(2), meta, base_format="nf4", dequantize=dequantize, **fields
        )
        runs.append((losses, meta["dense_weights"], meta["dense_per_call_layers"]))
    assert runs[0][1:] == (True, [2]) and runs[1][1:] == (False, [])
    assert runs[0][0] == runs[1][0]


@pytest.mark.gpu
def test_a_fused_stage_left_per_call_on_cuda_trains_as_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On cuda:0, compiled layers, bf16: a plan that leaves a layer per call beside runs holding
    copies (`roundpipe.planning.even_stages`) trains as every call dequantizing."""
    monkeypatch.setattr("roundpipe.plan_meta.per_call_layers_of", lambda memory: frozenset((2,)))
    results, metas = [], []
    for dequantize in ("run", "call"):
        meta: dict[str, Any] = {}
        fields = dict(devices="cuda:0", num_microbatches=3, precision="bf16", compile=True)
        model = lora_qwen3()
        losses = pipe_loop(model, token_data(3), meta, base_format="nf4", dequantize=dequantize, **fields)
        results.append((losses, adapters(model)))
        metas.append(meta)
    (mixed_losses, mixed_adapters), (call_losses, call_adapters) = results
    assert metas[0]["dense_weights"] and metas[0]["dense_per_call_layers"] == [2]
    assert mixed_losses == pytest.approx(call_losses, rel=1e-2, abs=1e-2)
    for name, tensor in call_adapters.items():
        torch.testing.assert_close(mixed_adapters[name], tensor, rtol=2e-2, atol=2e-3, msg=name)


def test_an_out_of_memory_error_names_the_dense_copies_and_the_per_call_remedy() -> None:
    from roundpipe.backends.holdings import device_holdings, out_of_memory_error
    from roundpipe.backends.host_data import RunKey
    from roundpipe.sched.task import COMPUTE, Task

    config = roundpipe.RunConfig(devices="cpu:1", async_optimizer=False, base_format="nf4", dequantize="run")
    with roundpipe.RoundPipe(lora_qwen3(), optimizer=sgd, config=config) as pipe:
        runtime = pipe.runtime
        block = dict(pipe.host.layer_params[1])
        run = RunKey(0, 7, 0, 3)
        named = {name: pipe.host.compute[id(param)] for name, param in block.items()}
        runtime.transient[run] = {1: named}
        runtime.dense.params(run, runtime.transient)  # a run holding its copies, as at a failure
        held = device_holdings(runtime, runtime.device(0))
        expected = dense_bytes(pipe.host.layers[1], torch.float32)  # fp32, the default precision
        task = Task(("compute", 7, 3, 0), COMPUTE, "compute0", device=0, stage="B2", slot=3, microbatch=0)
        message = str(out_of_memory_error(runtime, task, ""))
        runtime.dense.enabled = False
        without = str(out_of_memory_error(runtime, task, ""))
        runtime.dense.runs.clear()
        del runtime.transient[run]
    assert held["dense copies it7 slot3"] == expected > 0  # the transient tensors not counted again
    assert 'dequantize="call"' in message and "dense copies it7 slot3" in message
    assert 'dequantize="call"' not in without


def test_a_device_plan_records_whether_runs_hold_dense_copies() -> None:
    """Under a budget the plan decides ("auto"), and the trace says what it decided."""
    for dequantize, expected in (("auto", True), ("call", False)):
        meta: dict[str, Any] = {}
        pipe_loop(
            lora_qwen3(), token_data(1), meta, base_format="nf4", dequantize=dequantize, memory_budget="4GiB"
        )
        assert meta["dense_weights"] is expected
        assert any(meta["memory_prediction"]["slots"]) and meta["memory_budget_bytes"] == 4 << 30


def test_runs_hold_dense_copies_only_where_a_layer_holds_4_bit_weights() -> None:
    """A model may arrive quantized whatever base_format says; a model with none holds no copies."""
    cases = (
        (quantize_frozen_(lora_qwen3()), "compute", "auto", True),
        (lora_qwen3(), "compute", "auto", False),
    )
    for model, base_format, dequantize, expected in (*cases, (lora_qwen3(), "nf4", "call", False)):
        config = roundpipe.RunConfig(devices="cpu:1", base_format=base_format, dequantize=dequantize)
        with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
            assert pipe.runtime.dense.enabled is expected
