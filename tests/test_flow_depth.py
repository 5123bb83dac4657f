"""Inputs uploaded more microbatches ahead of their computes (`ScheduleOptions.flow_depth`).

A stage run's input for microbatch m waits for the compute of microbatch m - flow_depth to end
(its first ones for the device's run two before), so the host may issue that many of a stage's
computes before its weights have landed. Where issuing a compute takes the host longer than the
device takes to run it, the default two leave the device waiting for the host once the weights
land; deeper hides more of it, for one more activation on the device per microbatch, which the
memory model counts (``act_in_flight``). The planner takes `device_plan.FLOW_DEPTH` where the plan
fits with it. Deterministic: the fake stream backend's virtual clock and CPU workers.
"""

from __future__ import annotations

import pytest
from torch import nn

import roundpipe
from roundpipe.backends.fake import FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, partition
from roundpipe.planning import device_plan
from roundpipe.planning.device_plan import plan_from
from roundpipe.planning.simulate import run_graphs
from roundpipe.sched import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.keys import ActUpKey, ComputeKey
from tests.helpers import assert_weights_equal, batches, mlp, sgd, sync_reference, train_steps
from tests.test_prefetch_stages import memory

LAYERS = 10


def _builder(flow_depth: int, microbatches: int) -> tuple[GraphBuilder, LayerCosts]:
    costs = LayerCosts.uniform(LAYERS, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0, mem_bytes=1 << 20)
    plan = partition(costs, 1, microbatches, 6 << 20, async_optimizer=True)
    spec = ModelSpec.uniform(LAYERS, param_bytes=8 << 20, act_bytes=1 << 20)
    options = ScheduleOptions(round_size=microbatches, chunk_bytes=1 << 20, flow_depth=flow_depth)
    return GraphBuilder(plan, spec, 1, options), costs


def test_an_input_waits_for_the_compute_flow_depth_microbatches_back() -> None:
    builder, _ = _builder(4, 8)
    tasks = {t.key: t for t in builder.forward_backward(0, 0, 8).tasks}
    assert builder.meta()["flow_depth"] == 4
    for mb in range(8):
        up = tasks[ActUpKey(0, 2, mb)]  # the third forward slot
        expected = [ComputeKey(0, 2, mb - 4)] if mb >= 4 else [ComputeKey(0, 0, 7)]  # else: run two back
        assert list(up.sync_deps) == expected, (mb, up.sync_deps)
    with pytest.raises(ValueError, match="flow_depth must be >= 1"):
        ScheduleOptions(flow_depth=0)


def _makespan(flow_depth: int) -> float:
    """Four iterations of 8 microbatches on one device whose host takes 1 ms plus 2 ms a layer to
    issue a compute (the device: 1 ms a layer forward, 2 backward), the weights over an 8 GB/s link."""
    builder, costs = _builder(flow_depth, 8)

    def issue_ms(task: object) -> float:
        kind, layers = getattr(task, "kind"), getattr(task, "layers")  # noqa: B009
        return 1.0 + 2.0 * len(layers) if kind in ("compute", "recompute") else 0.02

    model = FakeCostModel(costs, link_gbps=8.0, optimizer_ms=0.3)
    backend = FakeStreamBackend(model, shared_link=True, issue_ms=issue_ms)
    _, trace = run_graphs(backend, builder, 4, 8)
    trace.check_rules()
    return trace.makespan_ms()


def test_deeper_flow_hides_the_hosts_issuing_where_it_outlasts_the_device() -> None:
    two, four = _makespan(2), _makespan(4)
    assert four < 0.98 * two, (two, four)


def test_the_planner_counts_the_deeper_flow_and_falls_back_where_it_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    costs = LayerCosts((2.0,) * 14, (6.0,) * 14, (10**9,) * 14)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=8, async_optimizer=True)
    default = plan_from(config, costs, memory(), 1, 24 << 30, kind="cuda")
    monkeypatch.setattr(device_plan, "FLOW_DEPTH", 4)
    deeper = plan_from(config, costs, memory(), 1, 24 << 30, kind="cuda")
    assert (default.prediction.act_in_flight, deeper.prediction.act_in_flight) == (2, 4)
    assert deeper.prediction.to_dict()["act_in_flight"] == 4
    assert deeper.plan != default.plan or deeper.prediction.peak_bytes > default.prediction.peak_bytes
    # No plan fits with four in flight: the default two, not an error.
    real = device_plan._within_budget

    def refusing_four(*args: object, in_flight: int, **kwargs: object) -> object:
        if in_flight > 2:
            raise roundpipe.PlanError("no plan fits with four in flight")
        return real(*args, in_flight=in_flight, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(device_plan, "_within_budget", refusing_four)
    fallback = plan_from(config, costs, memory(), 1, 24 << 30, kind="cuda")
    assert fallback.prediction.act_in_flight == 2 and fallback.plan == default.plan


@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_with_deeper_flow_keeps_the_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    data = batches(3, batch=16)
    _, reference = sync_reference(mlp(0, width=256, depth=6), sgd, data, nn.functional.mse_loss)
    monkeypatch.setattr(device_plan, "FLOW_DEPTH", 4)
    config = roundpipe.RunConfig(
        devices="cpu:1", num_microbatches=8, async_optimizer=False, memory_budget="3MiB", replan=False
    )
    with roundpipe.RoundPipe(mlp(0, width=256, depth=6), optimizer=sgd, config=config) as pipe:
        weights = train_steps(pipe, data, nn.functional.mse_loss)
        pipe.trace().check_rules()
        assert pipe.trace().meta["flow_depth"] == 4
    for got, want in zip(weights, reference, strict=True):
        assert_weights_equal(got, want, rtol=1e-5, atol=1e-6)
