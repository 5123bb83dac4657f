"""The memory model's arithmetic: sizes, stage kinds, the plan's peak and the partitioner's bound."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from roundpipe import RunConfig
from roundpipe.errors import ConfigError, PlanError
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.plan.memory import (
    LayerMemory,
    in_flight_reserve,
    layer_plan_bytes,
    partition_limit_bytes,
    per_layer_cap,
    plan_within_budget,
    predict_peak,
    stage_bytes,
)
from roundpipe.plan.sizes import format_bytes, parse_bytes

# Four layers with distinct numbers, so every term of every formula shows in the results.
MEM = LayerMemory(
    param_bytes=(10, 20, 30, 40),
    grad_bytes=(10, 20, 0, 40),
    saved_bytes=(100, 200, 300, 400),
    work_bytes=(5, 6, 7, 8),
    boundary_bytes=(50, 60, 70, 80),
    bwd_work_bytes=(1, 2, 3, 4),
    carried_bytes=(0, 10, 10, 10),
)


def simple_plan(fwd: tuple[range, ...], fused: range, bwd: tuple[range, ...], devices: int = 1) -> Plan:
    return Plan(fwd, fused, bwd, t_max=1.0, num_devices=devices, num_microbatches=4)


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2KiB", 2048),
        ("3kB", 3000),
        ("1000", 1000),
        ("64B", 64),
        (4096, 4096),
        ("0.5TiB", 2**39),
    ],
)
def test_parse_bytes_accepts_human_sizes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_reads_exponents_as_the_cli_always_has() -> None:
    assert parse_bytes("1.5e9") == 1_500_000_000 and parse_bytes("2e3KiB") == 2000 * 1024


@pytest.mark.parametrize("bad", ["24 Gb", "24gib", "lots", "", "1e", "-1GiB", "GiB"])
def test_parse_bytes_rejects_with_the_accepted_spellings(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"use e\.g\. '24GiB', '512MiB' or a number of bytes"):
        parse_bytes(bad)


def test_parse_bytes_message_quotes_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_bytes("24 Gb")
    assert str(info.value) == (
        "memory budget '24 Gb' is not understood; use e.g. '24GiB', '512MiB' or a number of bytes"
    )


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, None])
def test_parse_bytes_rejects_non_sizes(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(24 * 2**30) == "24.00 GiB"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(17) == "17 B"
    assert format_bytes(2**41) == "2.00 TiB"


# ---------------------------------------------------------------------- config


def test_run_config_memory_budget() -> None:
    assert RunConfig(memory_budget="24GiB").memory_budget_bytes() == 24 * 2**30
    assert RunConfig(memory_budget="24GiB").memory_budget == "24GiB"  # kept as the user wrote it
    assert RunConfig(memory_budget=10**9).memory_budget_bytes() == 10**9
    assert RunConfig().memory_budget is None and RunConfig().memory_budget_bytes() is None
    again = RunConfig(**RunConfig(memory_budget="512MiB", mem_limit_bytes=10**6).model_dump())
    assert again.memory_budget_bytes() == 512 * 2**20 and again.mem_limit_bytes == 10**6


@pytest.mark.parametrize("bad", ["24 Gb", 0, True, 1.5])
def test_run_config_rejects_bad_budget(bad: object) -> None:
    with pytest.raises(ConfigError, match="memory_budget: memory budget"):
        RunConfig(memory_budget=bad)


# ---------------------------------------------------------------------- facts


def test_layer_memory_defaults_and_validation() -> None:
    mem = LayerMemory((1, 2), (1, 0), (3, 4), (0, 0), (5, 6))
    assert mem.bwd_work_bytes == (0, 0) and mem.carried_bytes == (0, 0)
    assert mem.output_bytes(0) == 6 and mem.output_bytes(1) == 0
    assert LayerMemory(**json.loads(json.dumps(mem.to_dict()))) == mem
    assert LayerMemory(**MEM.to_dict()) == MEM
    with pytest.raises(PlanError, match=r"saved_bytes has 1 entries for 2 layers"):
        LayerMemory((1, 2), (1, 0), (3,), (0, 0), (5, 6))
    with pytest.raises(PlanError, match=r"work_bytes\[1\] is -1"):
        LayerMemory((1, 2), (1, 0), (3, 4), (0, -1), (5, 6))
    with pytest.raises(PlanError, match=r"layer 1 \('b'\): carried_bytes 7 > boundary_bytes 6"):
        LayerMemory((1, 2), (1, 0), (3, 4), (0, 0), (5, 6), carried_bytes=(0, 7), names=("a", "b"))
    with pytest.raises(PlanError, match="empty"):
        LayerMemory((), (), (), (), ())


def test_scaled_scales_activations_only() -> None:
    double = MEM.scaled(2.0)
    assert double.param_bytes == MEM.param_bytes and double.grad_bytes == MEM.grad_bytes
    assert double.saved_bytes == (200, 400, 600, 800)
    assert double.boundary_bytes == (100, 120, 140, 160) and double.carried_bytes == (0, 20, 20, 20)


# ---------------------------------------------------------------------- stage kinds


def test_forward_stage_is_params_plus_largest_layer_io_and_work() -> None:
    # layer 1: 60 in + 70 out - 10 shared constants + 6 work; layer 2: 70 + 80 - 10 + 7
    assert stage_bytes(MEM, range(1, 3), "fwd") == 50 + 147
    assert stage_bytes(MEM, range(3, 4), "fwd") == 40 + 80 + 8  # the head's output is a scalar


def test_fused_stage_holds_every_saved_activation() -> None:
    # params 70 + grads 40 + saved 300 + 400 + the head's backward working set 4 + its fresh
    # gradient 40 while it is added into the accumulated one
    assert stage_bytes(MEM, range(2, 4), "fused") == 70 + 40 + 744
    assert stage_bytes(MEM, range(2, 4), "fused", "layer") == 70 + 40 + 744  # it never recomputes


def test_a_gradient_computed_in_the_forward_is_not_counted_twice() -> None:
    """A chunked loss computes its weight gradient in the forward: it is among the saved bytes,
    and the backward hands it on instead of allocating a fresh one. Its forward holds it beside
    the working set (the weight gradient is allocated before the chunks of logits)."""
    ahead = replace(MEM, saved_bytes=(100, 200, 300, 440), saved_grad_bytes=(0, 0, 0, 40))
    # parameters 70 + gradients 40 + the forward of layer 3: saved 300 + 440 + working set 8;
    # its backward (300 + 440 + 4, no fresh gradient) is lower, and the gradient is not added twice.
    assert stage_bytes(ahead, range(2, 4), "fused") == 70 + 40 + 748
    assert ahead.scaled(2.0).saved_bytes == (200, 400, 600, 840)  # the gradient does not scale
    with pytest.raises(PlanError, match=r"saved_grad_bytes 500 > saved_bytes 440"):
        replace(ahead, saved_grad_bytes=(0, 0, 0, 500))


def test_backward_stage_grains() -> None:
    # stage grain: params 30 + grads 30 + saved 100 + 200 + backward working set 2 + fresh grad 20
    assert stage_bytes(MEM, range(0, 2), "bwd", "stage") == 30 + 30 + 322
    # layer grain: both layer inputs (50 + 50 own + 10 constants once) + one layer (200 + 2 + 20)
    assert stage_bytes(MEM, range(0, 2), "bwd", "layer") == 30 + 30 + 110 + 222


def test_layer_input_grain_holds_every_layer_input_and_output_beside_the_stage_recompute() -> None:
    # stage grain's 322 + both uploaded inputs (50 + 50 own + 10 constants once) as the outputs
    # each layer's graph keeps for its backward
    assert stage_bytes(MEM, range(0, 2), "bwd", "layer_input") == 30 + 30 + 322 + 110


def test_layer_input_grain_saves_and_uploads_every_backward_layer_input() -> None:
    plan = simple_plan((range(0, 3),), range(3, 4), (range(0, 3),))
    stage, inputs = predict_peak(plan, MEM, "stage"), predict_peak(plan, MEM, "layer_input")
    # The forward stage keeps layers 1 and 2's inputs (own bytes 50 and 60) for its computing
    # microbatch and two in flight; the backward stage's two next microbatches bring all three
    # inputs (50 + 50 + 60 own + 10 constants) and a gradient (80) each, not one input.
    assert inputs.slots[0].in_flight_bytes - stage.slots[0].in_flight_bytes == 3 * (50 + 60)
    assert inputs.slots[2].in_flight_bytes == 2 * (170 + 80)
    assert stage.slots[2].in_flight_bytes == 2 * (50 + 80)


def test_layer_grain_pays_off_on_deep_stages() -> None:
    deep = LayerMemory((1,) * 8, (1,) * 8, (1000,) * 8, (10,) * 8, (100,) * 8)
    assert stage_bytes(deep, range(8), "bwd", "layer") < stage_bytes(deep, range(8), "bwd", "stage") / 4


def test_stage_checks_its_range() -> None:
    with pytest.raises(PlanError, match="outside the 4 layers"):
        stage_bytes(MEM, range(2, 5), "fwd")
    with pytest.raises(PlanError, match="non-empty"):
        stage_bytes(MEM, range(2, 2), "fwd")
    with pytest.raises(PlanError, match="unknown stage kind"):
        stage_bytes(MEM, range(0, 1), "both")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the plan's peak


def test_predict_peak_one_device() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    prediction = predict_peak(plan, MEM, "stage")
    totals = [
        (s.stage_bytes, s.prefetch_bytes, s.in_flight_bytes, s.draining_bytes) for s in prediction.slots
    ]
    # F1 prefetches FB's params, FB prefetches B1's, B1 the next iteration's F1; two microbatches
    # of stage inputs and outputs are in flight besides the computing one (F1: 50 + 70, FB: 70,
    # B1: 50 + 70); once a run's last input is issued, one of its own ahead gives way to the next
    # run's first two (F1: 240 - 50 + 2 * 70 for FB's; FB: 140 - 70 + 2 * 120 for B1's input and
    # gradient; B1: F1's 2 * 50 are fewer than its own); the device's previous fused or backward
    # stage drains its weights and gradients (B1 before F1: 10 + 20 + 10 + 20; FB before B1:
    # 30 + 40 + 0 + 40; F1 before FB has no gradients). On one device B1's last recompute is gone
    # by then: the next run's first recompute waits for B1's last backward.
    assert totals == [(156, 70, 330, 60), (854, 30, 310, 0), (382, 30, 2 * 120, 110)]
    assert prediction.peak_bytes == 854 + 30 + 310 and prediction.peak_slot.index == 1
    assert not prediction.fits(1193) and prediction.fits(1194) and prediction.fits(None)
    assert "slot 1 (fused, layers [2, 4))" in prediction.describe()
    assert prediction.describe(2) == (
        "predicted peak 762 B in slot 2 (bwd, layers [0, 2)): stage 382 B + prefetch 30 B + activations in flight 240 B"
        " + previous stage draining 110 B"
    )
    d = json.loads(json.dumps(prediction.to_dict()))
    assert (
        d["peak_bytes"] == 1194 and d["slots"][1]["total_bytes"] == 1194 and d["slots"][1]["layers"] == [2, 4]
    )
    assert predict_peak(plan.slots, MEM).peak_bytes == 1194  # the slots alone work too


def test_on_several_devices_a_backward_stage_drains_with_its_last_recompute() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),), devices=2)
    # FB's device ran B1 two slots before it (cyclically): its weights and gradients (60) and its
    # last recompute (saved 100 + 200), which may still await a gradient from the other device.
    assert predict_peak(plan, MEM, "stage", num_devices=2).slots[1].draining_bytes == 60 + 300


def test_a_run_counts_the_next_runs_first_inputs_uploaded_beside_it() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    # The fused run's own input (70) for two microbatches; the backward run after it brings, per
    # microbatch, every layer's saved input (50 + 60 - 10, the carried 10 once) and the gradient
    # from above (70). On one device those come once the fused run's last input is issued, so one
    # of its two gives way to two of them (`roundpipe.plan.in_flight`).
    fused = predict_peak(plan, MEM, "layer_input").slots[1]
    assert fused.in_flight_bytes == 2 * 70 - 70 + 2 * (110 + 70)
    # Without inputs ahead the backward run uploads nothing before the fused run has ended.
    assert predict_peak(plan, MEM, "layer_input", inputs_ahead=False).slots[1].in_flight_bytes == 2 * 70
    # On two devices the fused slot's device runs the forward slot next, whose inputs (50) may
    # come at any time of the run: beside all of its own.
    two = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),), devices=2)
    assert predict_peak(two, MEM, "layer_input", num_devices=2).slots[1].in_flight_bytes == 2 * 70 + 2 * 50
    # One slot: the next run is the same slot's next iteration, whose input is its own.
    single = simple_plan((), range(0, 4), ())
    assert predict_peak(single, MEM).slots[0].in_flight_bytes == 2 * 50


def test_a_stage_with_small_gradients_drains_only_over_the_next_stages_start_before_its_upload() -> None:
    # Frozen weights with adapters: 1000 B of parameters and 10 B of gradients per layer.
    frozen = replace(MEM, param_bytes=(1000,) * 4, grad_bytes=(10,) * 4)
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    fused, backward = predict_peak(plan, frozen, "stage").slots[1:]
    # FB follows F1 (no drain); B1 follows FB, whose 2020 B of weights and gradients drain over
    # B1's start, where B1 holds its own 2020 B but not yet the 312 B its recompute builds up.
    # Without a stage uploaded ahead, that start is the slot's peak when the drain is larger.
    assert fused.draining_bytes == 0
    assert stage_bytes(frozen, range(0, 2), "bwd") == 2020 + 312
    assert predict_peak(plan, frozen, "stage", prefetch=0).slots[2].draining_bytes == 2020 - 312
    # With one stage ahead, F1's 2000 B upload waits for FB's last compute: the 1708 B drained
    # over B1's start never meet it (the measured MoE peaks: within 2.5% counted so, 25% above not).
    assert backward.draining_bytes == 0
    assert backward.total_bytes == 2332 + 2000 + backward.in_flight_bytes
    # A stage trained in full (gradients as large as its weights) keeps its whole drain.
    trained = replace(frozen, grad_bytes=(1000,) * 4)
    assert predict_peak(plan, trained, "stage").slots[2].draining_bytes == 4000


def test_predict_peak_prefetches_what_the_same_device_runs_next() -> None:
    plan = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),), devices=2)
    prediction = predict_peak(plan, MEM, num_devices=2)
    assert [s.prefetch_bytes for s in prediction.slots] == [30, 30, 70]  # slots 2, 0, 1
    assert [s.prefetch_bytes for s in predict_peak(plan, MEM, prefetch=0).slots] == [0, 0, 0]
    single = simple_plan((), range(0, 4), ())
    assert predict_peak(single, MEM).slots[0].prefetch_bytes == 100  # the next run's own copy


def test_forward_stage_holds_activations_saved_for_backward_stages_inside_it() -> None:
    plan = simple_plan((range(0, 3),), range(3, 4), (range(1, 3), range(0, 1)))
    first = predict_peak(plan, MEM, act_in_flight=2).slots[0]
    # edges 50 + 80 for two microbatches; layer 1's own input (60 - 10) for three; in the run's
    # tail one input of 50 gives way to the fused run's first two (80 each)
    assert first.in_flight_bytes == 2 * 130 + 3 * 50 - 50 + 2 * 80


def test_predict_peak_rejects_a_plan_for_other_layers() -> None:
    with pytest.raises(PlanError, match="covers 3 layers but the memory table 4"):
        predict_peak(simple_plan((), range(0, 3), ()), MEM)


# ---------------------------------------------------------------------- the partitioner's bound


def random_memory(rng: random.Random, n: int) -> LayerMemory:
    def col(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(rng.randint(lo, hi) for _ in range(n))

    boundary = col(10, 500)
    carried = tuple(rng.randint(0, b // 2) for b in boundary)
    return LayerMemory(col(0, 5000), col(0, 5000), col(0, 3000), col(0, 800), boundary, col(0, 800), carried)


def test_per_layer_sums_bound_every_stage_kind() -> None:
    rng = random.Random(7)
    for _ in range(30):
        mem = random_memory(rng, rng.randint(1, 9))
        per_layer = layer_plan_bytes(mem)
        for start in range(mem.num_layers):
            for stop in range(start + 1, mem.num_layers + 1):
                bound = sum(per_layer[start:stop]) + max(mem.carried_bytes)
                kinds = [
                    ("fwd", "stage"),
                    ("fused", "stage"),
                    ("bwd", "stage"),
                    ("bwd", "layer"),
                    ("bwd", "layer_input"),
                ]
                for kind, grain in kinds:
                    assert stage_bytes(mem, range(start, stop), kind, grain) <= bound  # type: ignore[arg-type]


@pytest.mark.parametrize("grain", ["stage", "layer", "layer_input"])
def test_partitioned_plans_fit_the_budget_exactly_predicted(grain: str) -> None:
    rng = random.Random(11)
    for trial in range(20):
        n = rng.randint(3, 24)
        mem = random_memory(rng, n)
        costs = LayerCosts((1.0,) * n, (2.0,) * n, layer_plan_bytes(mem, grain))  # type: ignore[arg-type]
        budget = 2 * max(costs.mem_bytes) + in_flight_reserve(mem) + 2 * max(mem.carried_bytes) + trial * 997
        devices = rng.randint(1, 4)
        plan = partition(costs, devices, 8, partition_limit_bytes(mem, budget))
        prediction = predict_peak(plan, mem, grain, num_devices=devices)  # type: ignore[arg-type]
        assert prediction.peak_bytes <= budget, (trial, prediction.describe())
        cap = per_layer_cap(mem, budget)
        assert all(costs.stage_mem(s.layers) <= cap for s in plan.slots)


def test_plan_within_budget_shrinks_until_the_exact_prediction_fits() -> None:
    big = simple_plan((), range(0, 4), ())
    split = simple_plan((range(0, 2),), range(2, 4), (range(0, 2),))
    limits: list[int] = []

    def make_plan(limit: int) -> Plan:
        limits.append(limit)
        return big if len(limits) == 1 else split  # the per-layer sums let the first one through

    budget = 1200
    assert predict_peak(big, MEM).peak_bytes > budget >= predict_peak(split, MEM).peak_bytes
    plan, prediction = plan_within_budget(make_plan, MEM, budget)
    assert plan is split and prediction.peak_bytes <= budget
    # The first limit is the optimistic one: a prefetched stage no larger than the largest layer.
    optimistic = 2 * (budget - in_flight_reserve(MEM) - 2 * max(MEM.carried_bytes) - max(MEM.param_bytes))
    assert limits[0] == max(partition_limit_bytes(MEM, budget), optimistic) and limits[1] < limits[0]


def test_plan_within_budget_names_the_stage_when_nothing_fits() -> None:
    whole = simple_plan((), range(0, 4), ())
    with pytest.raises(PlanError, match=r"no plan fits the memory budget .*slot 0 \(fused"):
        plan_within_budget(lambda limit: whole, MEM, 1200)
    with pytest.raises(PlanError, match="does not even hold the activations in flight"):
        partition_limit_bytes(MEM, 100)
    with pytest.raises(PlanError, match=r"memory budget 1.00 KiB \(at most [0-9.]+ B per stage\): no split"):
        plan_within_budget(refuse, MEM, 1024)
    shrinking: list[int] = []

    def big_then_refuse(limit: int) -> Plan:
        shrinking.append(limit)
        if len(shrinking) > 1:
            raise PlanError("no split")
        return whole

    with pytest.raises(PlanError, match=r"no plan fits the memory budget .*slot 0 \(fused"):
        plan_within_budget(big_then_refuse, MEM, 1200)
    assert len(shrinking) == 2


def refuse(limit: int) -> Plan:
    raise PlanError("no split")


def test_residuals_count_beside_each_layer_input_a_layer_input_run_holds() -> None:
    """A backward stage at layer_input holds each layer's residual beside its input; a forward
    stage holds those its layers keep (its first layer's too); the partitioner's bound grows by
    each layer's residual as much as by its own input; stage grain never sees them."""
    from roundpipe.plan.in_flight import held_inputs, own_in_flight

    with_residuals = replace(MEM, residual_bytes=(0, 7, 9, 11))
    assert held_inputs(with_residuals, range(1, 4)) - held_inputs(MEM, range(1, 4)) == 7 + 9 + 11
    plan = simple_plan((range(0, 2), range(2, 3)), range(3, 4), (range(1, 3), range(0, 1)))
    forward = plan.slots[0]
    held = frozenset({1, 2, 3})
    grown = own_in_flight(with_residuals, forward, held, 2, True, "layer_input")
    assert grown - own_in_flight(MEM, forward, held, 2, True, "layer_input") == 3 * 7  # layer 1, 3 times
    bound, plain = layer_plan_bytes(with_residuals), layer_plan_bytes(MEM)
    assert [b - p for b, p in zip(bound, plain, strict=True)] == [0, 3 * 7, 3 * 9, 3 * 11]
    for grain in ("stage", "layer_input"):
        peak = predict_peak(plan, with_residuals, grain).peak_bytes
        base = predict_peak(plan, MEM, grain).peak_bytes
        assert peak >= base and (peak > base) == (grain == "layer_input")
    assert with_residuals.without_residuals() == MEM
    assert with_residuals.scaled(2.0).residual_bytes == (0, 14, 18, 22)
    assert LayerMemory(**with_residuals.to_dict()) == with_residuals
