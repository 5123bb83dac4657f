"""The issue-ahead protocol (what the CUDA backend does) on the fake stream backend.

A device task may be issued once its device dependencies are issued; its work starts on the
device only after they have ended. Host work, and the flow-control dependencies a task lists in
``sync_deps`` (one stage prefetched, one microbatch ahead), wait for completion. The five rules
hold on the resulting trace, and running ahead hides the host's issue cost.
"""

from __future__ import annotations

import itertools

import pytest

from roundpipe.backends.fake import FakeBackend, FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.plan.kinds import SlotKind
from roundpipe.planning.simulate import run_graphs
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import TaskKind

LAYERS = 10


def _run(backend: FakeBackend, *, devices: int, microbatches: int, iterations: int, async_optimizer: bool):
    costs = LayerCosts.uniform(LAYERS, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0, mem_bytes=1 << 20)
    plan = partition(costs, devices, microbatches)
    spec = ModelSpec.uniform(LAYERS, param_bytes=4 << 20, act_bytes=1 << 20)
    builder = GraphBuilder(
        plan, spec, devices, ScheduleOptions(async_optimizer=async_optimizer, chunk_bytes=1 << 20)
    )
    return run_graphs(backend, builder, iterations, microbatches)


def _stream_backend(issue_ms: float = 0.0, link_gbps: float | None = 8.0) -> FakeStreamBackend:
    costs = LayerCosts.uniform(LAYERS, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0)
    model = FakeCostModel(costs, link_gbps=link_gbps, optimizer_ms=0.3, latency_ms=0.0)
    return FakeStreamBackend(model, shared_link=True, issue_ms=issue_ms)


@pytest.mark.parametrize("devices,async_optimizer", [(1, False), (2, True), (3, True), (2, False)])
def test_rules_and_device_order_hold(devices: int, async_optimizer: bool) -> None:
    engine, trace = _run(
        _stream_backend(issue_ms=0.05),
        devices=devices,
        microbatches=4,
        iterations=3,
        async_optimizer=async_optimizer,
    )
    assert engine.statistics().waiting == 0
    trace.check_rules()
    by_key = {t.key: t for t in trace}
    ahead = 0
    for task in trace:
        for dep_key in task.deps:
            dep = by_key.get(dep_key)
            if dep is None:
                continue
            # Whatever was issued early, work never starts before what it depends on has ended.
            assert task.start_t >= dep.end_t - 1e-9, (task.describe(), dep.describe())
            if task.device >= 0 and dep.device >= 0:
                if dep_key in task.sync_deps:
                    assert task.issue_t >= dep.end_t - 1e-9  # flow control waits for completion
                elif task.issue_t < dep.end_t:
                    ahead += 1
            else:
                assert task.issue_t < 0 or task.issue_t >= dep.end_t - 1e-9  # host edges: completion
    assert ahead > 0, "no device task was ever issued before its dependency completed"


def test_each_stream_runs_in_issue_order() -> None:
    _, trace = _run(
        _stream_backend(issue_ms=0.05), devices=2, microbatches=4, iterations=2, async_optimizer=True
    )
    lanes: dict[str, list] = {}
    for task in trace:
        if task.device >= 0:
            lanes.setdefault(task.lane, []).append(task)
    for tasks in lanes.values():
        tasks.sort(key=lambda t: t.issue_t)
        for before, after in itertools.pairwise(tasks):
            assert after.start_t >= before.end_t - 1e-9


def test_running_ahead_hides_the_issue_cost() -> None:
    """The host's cost of issuing a task (0.4 ms, against 1-3 ms layers) is mostly hidden when the
    device runs earlier work meanwhile; a backend that completes each task before the next one
    is issued pays it in full."""
    costs = LayerCosts.uniform(LAYERS, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0)

    def blocking(issue_ms: float) -> float:
        backend = FakeBackend(FakeCostModel(costs, optimizer_ms=0.3, latency_ms=issue_ms), shared_link=True)
        return _run(backend, devices=1, microbatches=4, iterations=3, async_optimizer=True)[1].makespan_ms()

    def ahead(issue_ms: float) -> float:
        backend = _stream_backend(issue_ms, link_gbps=None)
        return _run(backend, devices=1, microbatches=4, iterations=3, async_optimizer=True)[1].makespan_ms()

    ideal = blocking(0.0)
    assert ahead(0.0) == pytest.approx(ideal)
    assert ahead(0.4) - ideal < 0.65 * (blocking(0.4) - ideal)


def test_waiting_on_the_last_dependency_of_each_lane_is_waiting_on_all() -> None:
    """A stream runs its work in issue order, so the device tasks the CUDA backend waits on (the
    last dependency issued on each other lane, none on its own: `stream_waits`) start every task
    exactly when waiting on every dependency would."""
    from roundpipe.backends import fake_streams
    from roundpipe.backends.stream_waits import Issued

    def every(deps: object, issued: dict[object, Issued], lane: str) -> list[float]:
        return [issued[key].handle for key in deps if key in issued]  # type: ignore[attr-defined]

    def times() -> dict[object, tuple[float, float]]:
        _, trace = _run(
            _stream_backend(issue_ms=0.05), devices=2, microbatches=4, iterations=3, async_optimizer=True
        )
        return {t.key: (t.start_t, t.end_t) for t in trace}

    chosen = times()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fake_streams, "stream_waits", every)
        assert times() == chosen


def test_stream_waits_keeps_the_last_issued_dependency_of_each_other_lane() -> None:
    from roundpipe.backends.stream_waits import Issued, stream_waits

    issued = {
        ("p", 0): Issued("d0.param_up", 1, "p0"),
        ("p", 1): Issued("d0.param_up", 4, "p1"),
        ("a", 0): Issued("d0.act_up", 3, "a0"),
        ("c", 0): Issued("d0.compute", 2, "c0"),
        ("x", 0): Issued("d1.act_down", 5, "x0"),
    }
    deps = [("p", 0), ("p", 1), ("a", 0), ("c", 0), ("x", 0), ("done", 0)]
    # p1 covers p0 (issued later on the same stream); c0 is on the task's own stream; a completed
    # dependency ("done") needs no wait.
    assert sorted(stream_waits(deps, issued, "d0.compute")) == ["a0", "p1", "x0"]
    assert sorted(stream_waits(deps, issued, "d0.param_up")) == ["a0", "c0", "x0"]
    assert stream_waits([], issued, "d0.compute") == []


def _first_waits(devices: int, plan: Plan, param_bytes: tuple[int, ...]) -> list[int]:
    """The slots whose fused or backward runs' first compute (recompute) waited for the previous
    run's last compute to complete, after checking each wait is there exactly where that run uploads
    more than the run's farthest stage ahead, on one device only, and that it held on the trace."""
    spec = ModelSpec(param_bytes=param_bytes, owners=((),) * LAYERS, act_bytes=1 << 20)
    builder = GraphBuilder(plan, spec, devices, ScheduleOptions(chunk_bytes=1 << 20))
    _, trace = run_graphs(_stream_backend(issue_ms=0.05), builder, 2, 4)
    by_key = {t.key: t for t in trace}

    def uploaded(slot: int) -> int:
        return sum(param_bytes[layer] for layer in plan.slots[slot % plan.num_slots].layers)

    waited = []
    for first in trace:
        opens_run = first.kind == TaskKind.RECOMPUTE or (
            first.kind == TaskKind.COMPUTE and first.stage_kind == SlotKind.FUSED
        )
        if not opens_run or first.part != 0:
            continue
        if devices > 1 or uploaded(first.slot - 1) <= uploaded(first.slot + 1):
            assert first.sync_deps == (), first.describe()
            continue
        (before,) = first.sync_deps
        done = by_key[before]
        assert (
            done.kind == TaskKind.COMPUTE and done.part == done.num_parts - 1 and done.slot == first.slot - 1
        )
        assert first.issue_t >= done.end_t - 1e-9, (first.describe(), done.describe())
        waited.append(first.slot)
    return sorted(set(waited))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_after_a_heavier_one_starts_once_it_has_ended_on_one_device(devices: int) -> None:
    """The run before's frozen weights go once its last compute has run on the device; the memory
    model counts them gone before this run builds its activations, with the farthest stage's upload
    in their place. Where the run before uploads more than that stage, a host issuing ahead would
    build them beside it: a fused or backward run's first compute then waits for completion (after
    the fused stage with the head; after a forward stage longer than the first backward one).
    Elsewhere, and on several devices (whose model counts the overlap), it does not."""
    costs = LayerCosts.uniform(LAYERS, fwd_ms=1.0, bwd_ms=2.0, head_factor=3.0, mem_bytes=1 << 20)
    plan = partition(costs, devices, 4, mem_limit_bytes=8 << 20)  # stages of at most four layers
    with_head = (4 << 20,) * (LAYERS - 1) + (16 << 20,)
    assert _first_waits(devices, plan, with_head) == (
        [plan.num_slots - len(plan.bwd_stages)] if devices == 1 else []
    )
    if devices == 1:  # a last forward stage of four layers before a first backward stage of two
        forward, backward = (range(0, 4), range(4, 8)), (range(6, 8), range(3, 6), range(0, 3))
        uneven = Plan.from_stages(forward, range(8, LAYERS), backward, costs, 1, 4)
        assert _first_waits(devices, uneven, (4 << 20,) * LAYERS) == [2]  # the fused run
