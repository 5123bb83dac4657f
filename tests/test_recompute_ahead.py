"""A backward stage recomputes ahead of its gradient: the graph, the fake costs, the schedule.

Each microbatch of a backward stage run is act_up (the saved activation) -> recompute, and grad_up
(the gradient from the slot above) -> backward -> act_down. The recompute needs only the
activation, so it runs while the gradient is still on its way; it waits for the run's previous
backward, so a run never holds more than one recomputed microbatch waiting for its gradient.
Deterministic: the fake backend's virtual clock.
"""

from __future__ import annotations

import pytest

from roundpipe.backends.fake import FakeCostModel
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.planning.simulate import simulate
from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions, Trace
from roundpipe.sched.keys import ActDownKey, ComputeKey, GradUpKey, RecomputeKey
from roundpipe.sched.task import Task


def grid_costs(layers: int, bwd_ratio: float, head: float) -> LayerCosts:
    """As in bench/schedule.py --grid: an embedding of 1% of a layer, decoder layers, the head."""
    fwd = [0.01, *[1.0] * layers, head]
    bwd = [0.01 * bwd_ratio, *[bwd_ratio] * layers, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def sync_plan() -> tuple[LayerCosts, Plan]:
    costs = grid_costs(24, 2.0, 2.0)
    plan = partition(costs, 4, 8)
    assert len(plan.bwd_stages) >= 2
    return costs, plan


def by_key(trace: Trace) -> dict[object, Task]:
    return {t.key: t for t in trace.records}


def test_a_backward_microbatch_is_recompute_then_backward_with_the_gradient_apart() -> None:
    costs, plan = sync_plan()
    spec = ModelSpec.uniform(costs.num_layers, param_bytes=1000, act_bytes=100)
    builder = GraphBuilder(plan, spec, 4, ScheduleOptions())
    tasks = builder.forward_backward(0, 0, 8).tasks
    tasks_by_key = {t.key: t for t in tasks}
    position = {t.key: i for i, t in enumerate(tasks)}
    for task in tasks:  # emitted in dependency order: the engine may skip its cycle check
        assert all(position[d] < position[task.key] for d in task.deps if d in position), task
    last_slot = plan.num_slots - 1
    for slot in range(len(plan.fwd_stages) + 1, plan.num_slots):
        for mb in range(8):
            recompute = tasks_by_key[RecomputeKey(0, slot, mb)]
            grad_up = tasks_by_key[GradUpKey(0, slot, mb)]
            backward = tasks_by_key[ComputeKey(0, slot, mb)]
            assert recompute.lane.endswith(".compute") and grad_up.lane.endswith(".act_up")
            assert recompute.lane == backward.lane and recompute.device == grad_up.device
            assert ActDownKey(0, slot - 1, mb) in grad_up.deps
            assert not any(d[0] in ("act_down", "grad_up") for d in recompute.deps), recompute.deps
            assert set(backward.deps) == {recompute.key, grad_up.key}
            if recompute.part > 0:  # not the run's first microbatch (a run is one round's block)
                assert ComputeKey(0, slot, mb - 1) in recompute.deps
            assert grad_up.nbytes == 100 and tasks_by_key[("act_up", 0, slot, mb)].nbytes == 100
            down = tasks_by_key[ActDownKey(0, slot, mb)]
            assert down.nbytes == (0 if slot == last_slot else 100)


def test_fake_costs_split_a_backward_stage_into_its_forward_and_the_rest() -> None:
    costs = grid_costs(6, 2.5, 3.0)
    model = FakeCostModel(costs)
    layers = range(2, 5)
    recompute = Task(("recompute", 0, 3, 0), "recompute", "d0.compute", layers=layers, stage_kind="bwd")
    backward = Task(("compute", 0, 3, 0), "compute", "d0.compute", layers=layers, stage_kind="bwd")
    assert model.duration(recompute) == pytest.approx(costs.fwd_stage_ms(layers))
    assert model.duration(backward) == pytest.approx(sum(costs.bwd_ms[2:5]))
    assert model.duration(recompute) + model.duration(backward) == pytest.approx(costs.bwd_stage_ms(layers))


def test_recompute_starts_before_the_gradient_from_the_stage_above_arrives() -> None:
    costs, plan = sync_plan()
    trace = simulate(plan, costs, 4, 8, iterations=1, async_optimizer=False).trace
    tasks = by_key(trace)
    first_bwd = len(plan.fwd_stages) + 1
    ahead = []
    for slot in range(first_bwd, plan.num_slots):
        recompute, grad_up = tasks[RecomputeKey(0, slot, 0)], tasks[GradUpKey(0, slot, 0)]
        assert tasks[ComputeKey(0, slot, 0)].start_t >= max(recompute.end_t, grad_up.end_t)
        if grad_up.end_t > recompute.start_t:
            ahead.append(slot)
    assert ahead, "no backward stage recomputed microbatch 0 before its gradient arrived"
    assert first_bwd in ahead  # the stage right below the fused one waits for the whole forward


def awaiting_gradient(trace: Trace, group: str) -> dict[object, int]:
    """Per device or per run (``group``): the most recomputed microbatches that waited for their
    gradient at one moment (recompute ended, grad_up not yet ended)."""
    tasks = by_key(trace)
    events: dict[object, list[tuple[float, int]]] = {}
    for task in trace.records:
        if task.kind != "recompute":
            continue
        grad_up = tasks[GradUpKey(*task.key[1:])]
        if grad_up.end_t <= task.end_t:
            continue
        where = task.device if group == "device" else (task.device, task.iteration, task.round, task.slot)
        events.setdefault(where, []).extend([(task.end_t, 1), (grad_up.end_t, -1)])
    most: dict[object, int] = {}
    for where, points in events.items():
        count = 0
        for _, delta in sorted(points):
            count += delta
            most[where] = max(most.get(where, 0), count)
    return most


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_run_holds_at_most_one_recomputed_microbatch_waiting_for_its_gradient(
    async_optimizer: bool,
) -> None:
    costs = grid_costs(28, 2.0, 3.5)
    plan = partition(costs, 8, 16, async_optimizer=async_optimizer)
    trace = simulate(plan, costs, 8, 16, iterations=3, async_optimizer=async_optimizer).trace
    assert max(awaiting_gradient(trace, "run").values()) == 1
    # A device holds two runs at most (one drains while the next starts): one waiting each.
    assert max(awaiting_gradient(trace, "device").values()) <= 2


# Sync bubbles of these fixed plans (partition's) before the split, when a backward stage's
# compute waited for its gradient: the split must never make them worse.
BUBBLE_BEFORE_THE_SPLIT = {
    (24, 2.0, 2.0, 4, 8): 0.08187871153500087,
    (28, 2.5, 3.0, 8, 16): 0.24580092986889682,
    (32, 3.8, 2.0, 8, 16): 0.17822351044489435,
    (24, 1.3, 4.0, 4, 8): 0.18422511534747307,
}


@pytest.mark.parametrize("shape", list(BUBBLE_BEFORE_THE_SPLIT))
def test_the_sync_bubble_of_grid_shapes_gets_no_worse(shape: tuple[int, float, float, int, int]) -> None:
    layers, ratio, head, n, m = shape
    costs = grid_costs(layers, ratio, head)
    plan = partition(costs, n, m)
    bubble = simulate(plan, costs, n, m, iterations=1, async_optimizer=False).bubble_ratio
    assert bubble <= BUBBLE_BEFORE_THE_SPLIT[shape] + 1e-9


def test_on_one_device_a_run_recomputes_only_after_the_previous_run_is_done() -> None:
    """On one GPU the host runs ahead: a backward run whose weights and activation are there early
    (the one after the fused run, while the head's weights still wait for the optimizer) would
    recompute before the fused run started and keep those activations through all of it. Its first
    recompute waits for the previous run's last compute (a backward run's: its last backward), so
    two runs' recomputed activations never meet, as the memory model counts; on several devices
    there is no such dependency."""
    costs = grid_costs(12, 2.0, 2.0)
    stages = (range(0, 5), range(5, 10))
    plan = Plan(stages, range(10, 14), tuple(reversed(stages)), 0.0, 1, 4)
    spec = ModelSpec.uniform(costs.num_layers, param_bytes=1000, act_bytes=100)
    builder = GraphBuilder(plan, spec, 1, ScheduleOptions(round_size=4))  # as on CUDA: one run per slot
    tasks = {t.key: t for t in builder.forward_backward(0, 0, 4).tasks}
    fused_slot = len(plan.fwd_stages)
    for slot in range(fused_slot + 1, plan.num_slots):
        assert ComputeKey(0, slot - 1, 3) in tasks[RecomputeKey(0, slot, 0)].deps, slot
    trace = simulate(plan, costs, 1, 4, iterations=2, async_optimizer=False, round_size=4).trace
    done = by_key(trace)
    for iteration in (0, 1):
        for slot in range(fused_slot + 1, plan.num_slots):
            previous = done[ComputeKey(iteration, slot - 1, 3)]
            assert done[RecomputeKey(iteration, slot, 0)].start_t >= previous.end_t
    two = GraphBuilder(plan, spec, 2, ScheduleOptions(round_size=4))
    deps = {t.key: t.deps for t in two.forward_backward(0, 0, 4).tasks}
    assert not any(isinstance(k, ComputeKey) for k in deps[RecomputeKey(0, fused_slot + 2, 0)])
