"""One device's coarsest plan (roundpipe.plan.coarse), the planner's default there
(`device_plan.STAGES_ON_ONE_DEVICE`): every stage as long as the memory rule allows, a plan that
the exact prediction accepts, fewer slots than the evaluated choice ("balanced"), and the same
numbers."""

from __future__ import annotations

import pytest
from torch import nn

import roundpipe
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, partition
from roundpipe.plan.coarse import coarsest_plan
from roundpipe.plan.memory import LayerMemory, layer_plan_bytes
from roundpipe.planning import device_plan
from roundpipe.planning.device_plan import plan_from, planning_budget
from tests.helpers import assert_weights_equal, batches, mlp, sync_reference, train_steps
from tests.helpers import sgd_momentum as sgd
from tests.test_frozen_tail import coarse_plans

MIB = 1 << 20


def test_each_stage_is_as_long_as_fits() -> None:
    costs = LayerCosts.uniform(10, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0, mem_bytes=100)  # head: 300
    plan = coarsest_plan(costs, 4, 600)  # at most 300 bytes a stage
    assert plan.fwd_stages == (range(0, 3), range(3, 6), range(6, 9))
    assert plan.fused == range(9, 10)
    assert plan.bwd_stages == (range(6, 9), range(3, 6), range(0, 3))
    wider = coarsest_plan(costs, 4, 1000)  # 500 a stage: the head takes two layers with it
    assert (wider.fwd_stages, wider.fused, wider.bwd_stages) == (
        (range(0, 5), range(5, 7)),
        range(7, 10),
        (range(2, 7), range(0, 2)),
    )
    assert coarsest_plan(costs, 4, 10_000).num_slots == 1
    assert wider.num_slots < partition(costs, 1, 4, 1000).num_slots
    with pytest.raises(PlanError, match="layer 9 needs 300 bytes"):
        coarsest_plan(costs, 4, 200)


def test_coarse_forward_stages_beside_one_layer_backward_stages() -> None:
    costs = LayerCosts.uniform(10, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0, mem_bytes=100)
    coarse, one = coarsest_plan(costs, 4, 600), coarsest_plan(costs, 4, 600, backward_layers=1)
    assert (one.fwd_stages, one.fused) == (coarse.fwd_stages, coarse.fused)
    assert one.bwd_stages == tuple(range(i, i + 1) for i in range(8, -1, -1))


def test_the_switch_cuts_one_layer_backward_stages_on_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    costs, mem = _memory(24)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, async_optimizer=False)
    monkeypatch.setattr(device_plan, "STAGES_ON_ONE_DEVICE", "coarse")
    coarse = plan_from(config, costs, mem, 1, 2 << 30, kind="cuda")
    monkeypatch.setattr(device_plan, "BACKWARD_STAGE_LAYERS", 1)
    one = plan_from(config, costs, mem, 1, 2 << 30, kind="cuda")
    assert max(len(s) for s in coarse.plan.bwd_stages) > 1
    assert {len(s) for s in one.plan.bwd_stages} == {1}
    assert len(one.plan.fwd_stages) <= len(coarse.plan.fwd_stages)  # still the coarsest that fit
    assert one.prediction.fits(planning_budget(2 << 30, "cuda"))


def _memory(blocks: int) -> tuple[LayerCosts, LayerMemory]:
    mem = LayerMemory(
        param_bytes=(200 * MIB, *[100 * MIB] * blocks, 200 * MIB),
        grad_bytes=(0, *[2 * MIB] * blocks, 0),
        saved_bytes=(0, *[60 * MIB] * blocks, 100 * MIB),
        work_bytes=(8 * MIB, *[40 * MIB] * blocks, 120 * MIB),
        boundary_bytes=(0, *[8 * MIB] * (blocks + 1)),
    )
    # A light head: the slowest slot is one decoder layer's backward, so the evaluated choice cuts
    # one-layer backward stages wherever memory allows larger ones.
    costs = LayerCosts((0.05, *[1.0] * blocks, 0.5), (0.1, *[2.0] * blocks, 1.0), layer_plan_bytes(mem))
    return costs, mem


@pytest.mark.parametrize("devices", [1, 2])
def test_the_switch_takes_the_fewest_slots_that_fit_on_one_device(
    monkeypatch: pytest.MonkeyPatch, devices: int
) -> None:
    costs, mem = _memory(24)
    config = roundpipe.RunConfig(devices=f"cpu:{devices}", num_microbatches=8, async_optimizer=True)
    budget = 1 << 30
    coarse = plan_from(config, costs, mem, devices, budget, kind="cuda")  # the default
    monkeypatch.setattr(device_plan, "STAGES_ON_ONE_DEVICE", "balanced")
    balanced = plan_from(config, costs, mem, devices, budget, kind="cuda")
    assert coarse.prediction.fits(planning_budget(budget, "cuda"))
    if devices == 1:
        assert coarse.plan.num_slots < balanced.plan.num_slots
    else:  # several devices: the evaluated choice, as before
        assert coarse.plan == balanced.plan


def test_where_no_coarse_plan_fits_the_evaluated_choice_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    costs, mem = _memory(12)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, async_optimizer=True)
    monkeypatch.setattr(device_plan, "STAGES_ON_ONE_DEVICE", "balanced")
    balanced = plan_from(config, costs, mem, 1, 1 << 30, kind="cuda")

    def refuse(*args: object) -> None:
        raise PlanError("no coarse plan")

    monkeypatch.setattr(device_plan, "STAGES_ON_ONE_DEVICE", "coarse")
    monkeypatch.setattr(device_plan, "coarsest_plan", refuse)
    assert plan_from(config, costs, mem, 1, 1 << 30, kind="cuda").plan == balanced.plan


@pytest.mark.usefixtures("one_torch_thread")
def test_a_coarse_run_keeps_the_numerics_of_the_plain_loop() -> None:
    data = batches(3, batch=16)
    _, reference = sync_reference(mlp(0, width=256, depth=8), sgd, data, nn.functional.mse_loss)
    config = roundpipe.RunConfig(  # one device under a budget: the coarse plan, the default
        devices="cpu:1", num_microbatches=4, async_optimizer=False, memory_budget="3MiB", replan=False
    )
    # Pinned: the default takes it only with fewer slots than the plan from measured CPU times,
    # which move with the machine's load (the switch is tested on fixed costs above).
    with (
        coarse_plans(),
        roundpipe.RoundPipe(mlp(0, width=256, depth=8), optimizer=sgd, config=config) as pipe,
    ):
        weights = train_steps(pipe, data, nn.functional.mse_loss)
        pipe.trace().check_rules()
        plan = pipe.plan
    assert plan.num_slots > 1 and max(len(stage) for stage in plan.bwd_stages) > 1  # split, not finely
    for got, want in zip(weights, reference, strict=True):
        assert_weights_equal(got, want, rtol=1e-5, atol=1e-6)
