"""A backward stage's next input uploaded ahead, or only once the stage is done.

A backward run uploads each microbatch's saved activation (and its gradient) while the device's
previous microbatch or run still computes. With microbatches so large that one more activation
does not fit (one 262,144-token sequence of an 8B shape: 2 GiB each), the planner plans without
that upload ahead (`ScheduleOptions.inputs_ahead`): the memory model counts only the gradient in
flight beside a backward stage, and the graph makes the uploads wait for the previous backward.
Deterministic: CPU workers and integer memory tables.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.plan.memory import LayerMemory, layer_plan_bytes, predict_peak
from roundpipe.planning.device_plan import plan_from, planning_budget
from roundpipe.planning.simulate import simulate
from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.keys import ActUpKey, ComputeKey, GradUpKey
from roundpipe.sched.task import ACT_UP, COMPUTE, GRAD_UP, RECOMPUTE
from tests.helpers import assert_weights_equal, batches, sgd, sync_reference, train_steps

GIB, MIB = 1 << 30, 1 << 20


def long_sequence_memory(blocks: int = 32) -> LayerMemory:
    """An 8B shape at 262,144 tokens as a GPU profile measured it: embedding, decoder blocks
    (2 GiB activations carrying 128 MiB of rotary tables, 14 GiB saved + backward working set),
    LM head."""
    boundary = 2 * GIB + 128 * MIB
    return LayerMemory(
        param_bytes=(1002 * MIB, *[420 * MIB] * blocks, 1002 * MIB),
        grad_bytes=(0, *[16 * MIB] * blocks, 0),
        saved_bytes=(0, *[5 * GIB] * blocks, 2 * GIB),
        work_bytes=(2 * GIB, *[4 * GIB] * blocks, 3 * GIB),
        boundary_bytes=(4 * MIB, *[boundary] * (blocks + 1)),
        bwd_work_bytes=(0, *[9 * GIB] * blocks, 3 * GIB),
        carried_bytes=(0, *[128 * MIB] * (blocks + 1)),
    )


def long_costs(mem: LayerMemory) -> LayerCosts:
    n = mem.num_layers
    return LayerCosts(
        (10.0, *[2000.0] * (n - 2), 300.0), (20.0, *[5000.0] * (n - 2), 600.0), layer_plan_bytes(mem)
    )


def test_backward_stages_count_only_their_gradient_in_flight_without_inputs_ahead() -> None:
    mem = long_sequence_memory(4)
    plan = partition(long_costs(mem), 1, 1)
    ahead = predict_peak(plan, mem, "layer", act_in_flight=1)
    serial = predict_peak(plan, mem, "layer", act_in_flight=1, inputs_ahead=False)
    assert ahead.inputs_ahead and not serial.inputs_ahead
    for a, s in zip(ahead.slots, serial.slots, strict=True):
        assert (a.stage_bytes, a.prefetch_bytes, a.draining_bytes) == (
            s.stage_bytes,
            s.prefetch_bytes,
            s.draining_bytes,
        )
        if s.kind != "bwd":
            assert s.in_flight_bytes == a.in_flight_bytes
            continue
        stop = s.layers.stop
        gradient = mem.boundary_bytes[stop] - mem.carried_bytes[stop]  # a gradient carries no constants
        assert s.in_flight_bytes == gradient < a.in_flight_bytes
    assert serial.to_dict()["inputs_ahead"] is False


def test_the_planner_gives_up_uploading_ahead_only_when_nothing_else_fits() -> None:
    mem = long_sequence_memory()
    costs = long_costs(mem)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=1, recompute_grain="layer")
    usable = planning_budget(24 * GIB, "cuda")
    tight = plan_from(config, costs, mem, 1, 24 * GIB, kind="cuda")
    assert not tight.prediction.inputs_ahead and tight.prediction.fits(usable)
    assert not predict_peak(tight.plan, mem, "layer", act_in_flight=1).fits(usable)
    roomy = plan_from(config, costs, mem, 1, 32 * GIB, kind="cuda")
    assert roomy.prediction.inputs_ahead
    with pytest.raises(PlanError, match=r"no plan fits the memory budget 14\.00 GiB.*in flight 4\.25 GiB"):
        plan_from(config, costs, mem, 1, 16 * GIB, kind="cuda")  # the error of the usual uploads


def backward_uploads(inputs_ahead: bool) -> tuple[int, dict]:
    """One device, one microbatch: the number of forward slots and the tasks of two iterations."""
    one_layer = tuple(range(i, i + 1) for i in range(5))
    plan = Plan(one_layer, range(5, 6), one_layer[::-1], t_max=1.0, num_devices=1, num_microbatches=1)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    builder = GraphBuilder(plan, spec, 1, ScheduleOptions(inputs_ahead=inputs_ahead))
    tasks = [*builder.forward_backward(0, 0, 1).tasks, *builder.forward_backward(1, 0, 1).tasks]
    return len(plan.fwd_stages), {t.key: t for t in tasks}


@pytest.mark.parametrize("inputs_ahead", [True, False])
def test_without_inputs_ahead_a_backward_runs_uploads_wait_for_the_previous_run(inputs_ahead: bool) -> None:
    forward_slots, tasks = backward_uploads(inputs_ahead)
    for t in (0, 1):
        for slot in range(forward_slots + 2, 2 * forward_slots + 1):  # backward runs after another one
            previous, two_back = ComputeKey(t, slot - 1, 0), ComputeKey(t, slot - 2, 0)
            for key in (ActUpKey(t, slot, 0), GradUpKey(t, slot, 0)):
                deps = tasks[key].deps
                assert (previous in deps) is not inputs_ahead, (key, deps)
                assert (two_back in deps) is inputs_ahead, (key, deps)


def blocks_model() -> nn.Sequential:
    """Blocks that save 9x their input for the backward: backward stages make the peak."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 32)) for _ in range(4)]
    return nn.Sequential(nn.Linear(8, 32), *blocks, nn.Linear(32, 4))


# On CPU workers the saved bytes are counted exactly (autograd's saved tensors): with 512-row
# batches the finest plan's peak is 1,121,024 bytes with the next input uploaded ahead and
# 1,055,488 without it, and every coarser plan needs more.
BETWEEN_BYTES = 1_090_000


@pytest.mark.usefixtures("one_torch_thread")
def test_a_budget_only_serial_uploads_fit_trains_as_the_plain_loop() -> None:
    data = batches(2, batch=512)
    _, ref_weights = sync_reference(blocks_model(), sgd, data, nn.functional.mse_loss)
    config = roundpipe.RunConfig(
        devices="cpu:1", num_microbatches=1, async_optimizer=False, memory_budget=BETWEEN_BYTES, replan=False
    )
    with roundpipe.RoundPipe(blocks_model(), optimizer=sgd, config=config) as pipe:
        weights = train_steps(pipe, data, nn.functional.mse_loss)
        trace = pipe.trace()
        trace.check_rules()
        prediction = pipe.memory_prediction
    assert prediction is not None and not prediction.inputs_ahead and prediction.fits(BETWEEN_BYTES)
    assert trace.meta["inputs_ahead"] is False
    computes = [t for t in trace.records if t.kind in (COMPUTE, RECOMPUTE)]
    uploads = [
        t for t in trace.records if t.kind in (ACT_UP, GRAD_UP) and isinstance(t.key, ActUpKey | GradUpKey)
    ]
    backward_slots = {t.key.slot for t in computes if t.kind == RECOMPUTE}
    for upload in (u for u in uploads if u.key.slot in backward_slots):
        # No other slot's compute is running while a backward run's input or gradient uploads.
        busy = [c for c in computes if c.start_t < upload.start_t < c.end_t and c.key.slot != upload.key.slot]
        assert not busy, (upload.key, [c.key for c in busy])
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("devices", "microbatches"), [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2)])
def test_serial_uploads_finish_keep_the_rules_and_cost_the_exposed_uploads(
    devices: int, microbatches: int
) -> None:
    """On the fake engine's virtual clock, every shape runs to the end under the five rules, its
    uploads at the link's speed; on one device with one microbatch, with activations that take a
    tenth of a stage to upload, waiting for them lengthens a run by at most an activation and a
    gradient upload per backward run. (With several devices on one shared link it can even be
    shorter: fewer uploads compete with the weights.)"""
    costs = LayerCosts((1.0,) * 8, (2.0,) * 8, (0,) * 8)
    plan = partition(costs, devices, microbatches)
    if not plan.bwd_stages:  # one device: the partitioner fuses everything; take one layer a stage
        one_layer = tuple(range(i, i + 1) for i in range(7))
        plan = Plan.from_stages(
            list(one_layer), range(7, 8), list(one_layer[::-1]), costs, devices, microbatches
        )
    options: dict = dict(iterations=2, link_gbps=1.0, param_bytes=(0,) * 8, act_bytes=100_000)
    ahead = simulate(plan, costs, devices, microbatches, **options)
    serial = simulate(plan, costs, devices, microbatches, inputs_ahead=False, **options)
    serial.trace.check_rules()
    uploads = [t for t in serial.trace.records if t.kind == ACT_UP]
    assert uploads and all(t.end_t - t.start_t == pytest.approx(0.1) for t in uploads)
    if (devices, microbatches) == (1, 1):
        backward_runs = 2 * len(plan.bwd_stages)
        assert ahead.makespan_ms < serial.makespan_ms <= ahead.makespan_ms + backward_runs * 2 * 0.1 + 1e-9


def test_the_next_runs_first_inputs_come_once_the_current_runs_last_one_is_issued() -> None:
    """The schedule `roundpipe.plan.in_flight` counts on one device: the backward run after the
    fused one uploads its first two microbatches' inputs (and gradients) once the device's run two
    before has completed and the fused run's last input is issued, which itself waits for the fused
    compute two microbatches before it. So while the fused run computes its third microbatch, its
    fourth input and the backward run's first two may all be on the device, never more."""
    plan = Plan((range(0, 2),), range(2, 4), (range(0, 2),), t_max=1.0, num_devices=1, num_microbatches=4)
    spec = ModelSpec.uniform(plan.num_layers, param_bytes=1000, act_bytes=100)
    builder = GraphBuilder(plan, spec, 1, ScheduleOptions(round_size=4))
    tasks = {
        t.key: t for t in [*builder.forward_backward(0, 0, 4).tasks, *builder.forward_backward(1, 0, 4).tasks]
    }
    fused_last = ActUpKey(1, 1, 3)
    assert tasks[fused_last].sync_deps == (ComputeKey(1, 1, 1),)
    for key in (ActUpKey(1, 2, 0), ActUpKey(1, 2, 1), GradUpKey(1, 2, 0), GradUpKey(1, 2, 1)):
        deps = tasks[key].deps
        assert fused_last in deps and tasks[key].sync_deps == (ComputeKey(1, 0, 3),), (key, deps)
        assert not any(isinstance(d, ComputeKey) and d.slot == 1 for d in deps)  # no fused compute
    # The third input waits for the first backward: the flow control within the run.
    assert ComputeKey(1, 2, 0) in tasks[ActUpKey(1, 2, 2)].sync_deps
