"""Parameters uploaded more than one stage ahead (`ScheduleOptions.prefetch_stages`).

A device's run k uploads its weights once its run k - 1 - prefetch_stages has ended. With one
stage ahead a link-bound forward stage idles the GPU and a compute-bound backward stage idles the
link; further ahead the link goes on with the next stages. The planner takes more stages only on
CUDA, after measuring the link, where the fake engine finds them faster and the memory model
finds them under the budget (`planning.link_refine.with_prefetch`). Deterministic: the fake
engine's virtual clock and CPU workers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.plan import LayerCosts, Plan
from roundpipe.plan.memory import LayerMemory, predict_peak
from roundpipe.planning import device_plan as device_plans
from roundpipe.planning.device_plan import DevicePlan, planning_budget
from roundpipe.planning.link_plan import link_iteration_ms
from roundpipe.planning.link_refine import MAX_PREFETCH_STAGES, with_prefetch
from roundpipe.planning.simulate import simulate
from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.keys import ComputeKey, ParamUpKey
from roundpipe.sched.task import PARAM_UP
from tests.helpers import assert_weights_equal, batches, sgd, sync_reference, train_steps

GB, GIB = 10**9, 1 << 30
LAYERS = 14
UPLOAD = (GB,) * LAYERS  # 20 ms a layer at 50 GB/s


def one_layer_stages(layers: int = LAYERS, microbatches: int = 4) -> Plan:
    """Forward stages of two layers, a fused stage of the last two, backward stages of two."""
    stages = tuple(range(i, i + 2) for i in range(0, layers - 2, 2))
    return Plan(stages, range(layers - 2, layers), stages[::-1], 1.0, 1, microbatches)


def link_bound_forward_costs() -> LayerCosts:
    """A layer computes 2 ms forward and 6 ms backward per microbatch: at 4 microbatches a
    forward stage (16 ms) waits for its 40 ms upload, a backward stage (64 ms) outlasts it."""
    return LayerCosts((2.0,) * LAYERS, (6.0,) * LAYERS, UPLOAD)


def memory(param_bytes: int = GB) -> LayerMemory:
    return LayerMemory(
        param_bytes=(param_bytes,) * LAYERS,
        grad_bytes=(1 << 20,) * LAYERS,
        saved_bytes=(64 << 20,) * LAYERS,
        work_bytes=(64 << 20,) * LAYERS,
        boundary_bytes=(16 << 20,) * LAYERS,
        bwd_work_bytes=(128 << 20,) * LAYERS,
        carried_bytes=(0,) * LAYERS,
    )


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_a_run_uploads_once_the_run_prefetch_plus_one_before_has_ended(prefetch: int) -> None:
    plan = one_layer_stages(microbatches=1)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    builder = GraphBuilder(plan, spec, 1, ScheduleOptions(prefetch_stages=prefetch))
    tasks = [*builder.forward_backward(0, 0, 1).tasks, *builder.forward_backward(1, 0, 1).tasks]
    slots = plan.num_slots
    runs = [(t, slot) for t in (0, 1) for slot in range(slots)]  # one device: one run per slot
    for k, (t, slot) in enumerate(runs):
        uploads = [x for x in tasks if x.kind == PARAM_UP and x.key.iteration == t and x.key.slot == slot]
        assert uploads
        before = k - 1 - prefetch
        for upload in uploads:
            waits = {d for d in upload.deps if isinstance(d, ComputeKey)}
            if before < 0:
                assert not waits, (upload.key, waits)
            else:  # the last compute of that run (one microbatch: its only one)
                assert waits == {ComputeKey(*runs[before], 0)}, (upload.key, waits)
                assert set(upload.sync_deps) == waits  # on its completion, not its issue
            assert isinstance(upload.key, ParamUpKey)


def test_fewer_than_one_stage_ahead_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch_stages must be >= 1"):
        ScheduleOptions(prefetch_stages=0)


def test_deeper_prefetch_from_the_next_iteration_on_waits_for_the_runs_before_the_switch() -> None:
    """The planner switches the options between iterations (the CUDA re-plan): the first runs
    after a switch to three stages ahead already wait for the run four before."""
    plan = one_layer_stages(microbatches=1)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    from roundpipe.sched.graph import RUNS_KEPT

    assert MAX_PREFETCH_STAGES + 1 <= RUNS_KEPT  # the deepest choice finds its run
    builder = GraphBuilder(plan, spec, 1, ScheduleOptions())
    builder.forward_backward(0, 0, 1)
    builder.options = ScheduleOptions(prefetch_stages=3)
    tasks = builder.forward_backward(1, 0, 1).tasks
    slots = plan.num_slots
    for slot in range(3):  # each waits for a run of iteration 0: 4 runs before on the one device
        uploads = [x for x in tasks if x.kind == PARAM_UP and x.key.slot == slot]
        assert uploads
        for upload in uploads:
            assert set(upload.sync_deps) == {ComputeKey(0, slots - 4 + slot, 0)}, upload.key


def test_on_the_fake_engine_stages_ahead_fill_the_links_idle_backward_and_keep_the_rules() -> None:
    plan, costs = one_layer_stages(), link_bound_forward_costs()
    times = {}
    for prefetch in (1, 2, 3):
        result = simulate(
            plan,
            costs,
            1,
            4,
            iterations=4,
            link_gbps=50.0,
            param_bytes=UPLOAD,
            round_size=4,
            prefetch_stages=prefetch,
        )
        result.trace.check_rules()
        assert result.trace.meta["prefetch_stages"] == prefetch
        times[prefetch] = result.makespan_ms
    link_ms = 4 * (2 * LAYERS - 2) * 20.0  # every stage's upload, fused once, four iterations
    assert times[1] > times[2] > times[3] >= link_ms
    assert times[2] < 0.97 * times[1]


def device_plan(budget_bytes: int | None, param_bytes: int = GB) -> DevicePlan:
    plan, mem = one_layer_stages(), memory(param_bytes)
    prediction = predict_peak(plan, mem, "stage", act_in_flight=2)
    return DevicePlan(plan, link_bound_forward_costs(), mem, prediction, budget_bytes, "cuda")


def cuda_config() -> roundpipe.RunConfig:
    return roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, round_size=4)


def one_ahead_ms(chosen: DevicePlan) -> float:
    return link_iteration_ms(chosen.plan, chosen.costs, UPLOAD, 50.0, 4, async_optimizer=True, round_size=4)


def test_the_planner_takes_stages_ahead_while_they_fit_and_pay() -> None:
    roomy = device_plan(64 * GIB)
    chosen = with_prefetch(roomy, cuda_config(), 50.0, UPLOAD, one_ahead_ms(roomy))
    assert chosen.prediction.prefetch == 3  # each further stage paid on this plan
    assert chosen.prediction.to_dict()["prefetch"] == 3
    assert chosen.plan == roomy.plan and chosen.prediction.fits(planning_budget(64 * GIB, "cuda"))
    # Each slot counts the parameters of the three stages its device runs next.
    slots = chosen.prediction.slots
    for i, slot in enumerate(slots):
        ahead = [slots[(i + k) % len(slots)] for k in (1, 2, 3)]
        assert slot.prefetch_bytes == sum(len(s.layers) * GB for s in ahead)

    one_stage_more = roomy.prediction.peak_bytes + 2 * GB  # room for a second stage, not a third
    budget = (one_stage_more * 8 + 6) // 7 + 1  # planning_budget keeps an eighth for the allocator
    assert planning_budget(budget, "cuda") >= one_stage_more
    tight = device_plan(budget)
    assert with_prefetch(tight, cuda_config(), 50.0, UPLOAD, one_ahead_ms(tight)).prediction.prefetch == 2
    unbudgeted = device_plan(None)
    assert with_prefetch(unbudgeted, cuda_config(), 50.0, UPLOAD, 1e9).prediction.prefetch == 1


def test_the_planner_keeps_one_stage_ahead_where_more_does_not_pay() -> None:
    """Compute-bound everywhere (a hundredth of the bytes): uploads already hide, nothing to gain."""
    small = (GB // 100,) * LAYERS
    roomy = device_plan(64 * GIB, GB // 100)
    ms = link_iteration_ms(roomy.plan, roomy.costs, small, 50.0, 4, async_optimizer=True, round_size=4)
    assert with_prefetch(roomy, cuda_config(), 50.0, small, ms).prediction.prefetch == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_two_stages_ahead_trains_as_the_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's choice reaches the graph (and the trace's meta); the order of uploads
    changes, the numbers do not."""
    real = device_plans.plan_from

    def two_ahead(*args: Any, **kwargs: Any) -> DevicePlan:
        made = real(*args, **kwargs)
        return replace(made, prediction=replace(made.prediction, prefetch=2))

    monkeypatch.setattr(device_plans, "plan_from", two_ahead)

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        blocks = (nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5))
        return nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 4))

    data = batches(3, batch=8)
    _, ref_weights = sync_reference(model(), sgd, data, nn.functional.mse_loss)
    config = roundpipe.RunConfig(
        devices="cpu:1", num_microbatches=2, async_optimizer=False, memory_budget="4GiB", replan=False
    )
    with roundpipe.RoundPipe(model(), optimizer=sgd, config=config) as pipe:
        weights = train_steps(pipe, data, nn.functional.mse_loss)
        trace = pipe.trace()
        trace.check_rules()
    assert trace.meta["prefetch_stages"] == 2
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want, rtol=1e-5, atol=1e-6)
