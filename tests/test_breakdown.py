"""The trace breakdown: busy, bubble and exposed transfer on hand-built and simulated traces."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from roundpipe.plan import LayerCosts, partition
from roundpipe.sched import simulate
from roundpipe.sched.breakdown import TraceBreakdown, breakdown
from roundpipe.sched.task import Key, Task, device_lane
from roundpipe.sched.trace import Trace


def _task(
    key: Key,
    kind: str,
    device: int,
    start: float,
    end: float,
    *,
    deps: tuple[Key, ...] = (),
    iteration: int = 1,
    step: int = -1,
) -> Task:
    lane = "host.optimizer" if device < 0 else device_lane(device, kind)
    task = Task(key, kind, lane, deps=deps, device=device, iteration=iteration, step=step)
    task.start_t, task.end_t = start, end
    return task


def _hand_made() -> Trace:
    """Device 0: C1 waits for its parameters (before the window), C2 waits 1 ms for its input, a
    prefetch for C3 runs in C2's gap, and C3's gap has no transfer. Device 1: D waits for an
    act_down on device 0 and then its own act_up (a chain). Iteration 0 is outside the measure."""
    return Trace(
        [
            _task(("c0",), "compute", 0, -5.0, -3.0, iteration=0),
            _task(("p1",), "param_up", 0, 0.0, 2.0),
            _task(("c1",), "compute", 0, 2.0, 5.0, deps=(("p1",),)),
            _task(("a2",), "act_up", 0, 4.0, 6.0),
            _task(("q3",), "param_up", 0, 5.0, 5.5),
            _task(("c2",), "compute", 0, 6.0, 8.0, deps=(("a2",), ("c1",))),
            _task(("c3",), "compute", 0, 9.0, 10.0, deps=(("q3",), ("c2",))),
            _task(("x",), "act_down", 0, 5.0, 6.5, deps=(("c1",),)),
            _task(("u",), "act_up", 1, 6.5, 7.0, deps=(("x",),)),
            _task(("d",), "compute", 1, 7.0, 9.0, deps=(("u",),)),
            _task(("g",), "grad_down", 1, 9.0, 9.5, deps=(("d",),)),
            _task(("gc",), "g_copy", -1, 9.5, 9.75, deps=(("g",),), step=3),
            _task(("st",), "step", -1, 9.75, 10.75, deps=(("gc",),), iteration=-1, step=3),
            _task(("st_old",), "step", -1, -2.0, -1.0, iteration=-1, step=2),
        ]
    )


def test_hand_made_trace_is_broken_down_by_the_definition() -> None:
    report = breakdown(_hand_made(), iterations=[1])
    assert report.iterations == (1,)
    assert report.window_ms == (2.0, 10.0)
    d0, d1 = report.devices[0], report.devices[1]
    assert d0.busy_ms == pytest.approx(6.0)
    assert d0.bubble == pytest.approx(2.0 / 8.0)
    # C2's gap [5, 6) waits on a2; q3 runs then too but feeds C3, whose gap [8, 9) has no transfer.
    assert d0.exposed_transfer_ms == pytest.approx(1.0)
    assert d0.exposed_transfer == pytest.approx(1.0 / 8.0)
    assert d0.exposed_ms_by_kind == {"act_up": pytest.approx(1.0)}
    # D's gap is [2, 7): the act_down on device 0 then the act_up on device 1 feed it.
    assert d1.busy_ms == pytest.approx(2.0)
    assert d1.exposed_transfer_ms == pytest.approx(2.0)
    assert d1.exposed_ms_by_kind == {"act_down": pytest.approx(1.5), "act_up": pytest.approx(0.5)}
    # The trailing gap [9, 10) has no next compute on device 1: not exposed, but idle.
    assert d1.bubble == pytest.approx(6.0 / 8.0)
    assert report.bubble == pytest.approx((0.25 + 0.75) / 2)
    assert report.exposed_transfer == pytest.approx((1.0 / 8.0 + 2.0 / 8.0) / 2)


def test_host_bound_is_device_time_before_the_host_finished_issuing() -> None:
    trace = _hand_made()
    by_key = {t.key: t for t in trace}
    by_key[("c1",)].issue_t = 3.5  # the GPU ran c1 from 2.0 while the host issued until 3.5
    by_key[("c2",)].issue_t = 5.0  # issued before its device start at 6.0: the host was ahead
    by_key[("c3",)].issue_t = 12.0  # still issuing after the end: the whole task, clipped to W
    by_key[("d",)].issue_t = 8.0
    report = breakdown(trace, iterations=[1])
    assert report.devices[0].host_bound_ms == pytest.approx(1.5 + 1.0)
    assert report.devices[0].host_bound == pytest.approx(2.5 / 8.0)
    assert report.devices[1].host_bound_ms == pytest.approx(1.0)
    assert report.host_bound == pytest.approx((2.5 / 8.0 + 1.0 / 8.0) / 2)
    assert breakdown(_hand_made(), iterations=[1]).host_bound == 0.0  # no issue times: none counted


def _issued(*more: tuple[Key, float, float]) -> tuple[Trace, dict[Key, Task]]:
    """The hand-made trace with ready and issue times on device 0's computes (and ``more``)."""
    trace = _hand_made()
    by_key = {t.key: t for t in trace}
    times = [(("c0",), -9.0, -8.0), (("c1",), 0.0, 3.5), (("c2",), 3.0, 5.0), (("c3",), 7.0, 7.5), *more]
    for key, ready, issued in times:
        by_key[key].ready_t, by_key[key].issue_t = ready, issued
    return trace, by_key


def test_issue_time_runs_from_when_the_lane_could_take_a_task_to_its_issue() -> None:
    trace, _ = _issued()
    # c1 from its ready time (0.0); c2 ready at 3.0 while the lane issued c1 until 3.5; c3 ready
    # after c2 was issued. c0 is iteration 0's; d (device 1) has no issue time: not counted.
    report = breakdown(trace, iterations=[1])
    assert report.issue_ms_per_iteration == {"compute": pytest.approx(3.5 + 1.5 + 0.5)}
    assert report.to_dict()["issue_ms_per_iteration"] == {"compute": 5.5}
    assert breakdown(_hand_made(), iterations=[1]).issue_ms_per_iteration == {}


def test_pacing_says_whether_the_host_or_the_device_paces_the_compute_lane() -> None:
    from roundpipe.sched.breakdown import pacing

    assert pacing(_hand_made()) is None  # no issue times: a backend that completes as it issues
    trace, by_key = _issued((("d",), 6.5, 7.2))
    # Iteration 0 is left out (it compiles): c1-c3 and d issued in 3.5 + 1.5 + 0.5 + 0.7 ms and
    # ran 3 + 2 + 1 + 2; host-bound 1.5 of 8 ms on device 0, 0.2 on device 1.
    assert pacing(trace) == (
        "iterations 1, per iteration: compute issued in 6.2 ms, run in 8.0 "
        "(the devices pace the compute lanes; host-bound 10.6%)"
    )
    by_key[("c3",)].issue_t = 9.5  # the host still issuing c3 well into its run
    assert "the host paces the compute lanes" in (pacing(trace) or "")


def test_busy_per_kind_counts_the_steps_the_iterations_feed() -> None:
    busy = breakdown(_hand_made(), iterations=[1]).busy_ms_per_iteration
    assert busy["compute"] == pytest.approx(3.0 + 2.0 + 1.0 + 2.0)
    assert busy["param_up"] == pytest.approx(2.5)
    assert busy["g_copy"] == pytest.approx(0.25)
    assert busy["step"] == pytest.approx(1.0)  # step 3 only: step 2 belongs to iteration 0's step


def test_default_iterations_and_empty_selection() -> None:
    everything = breakdown(_hand_made())
    assert everything.iterations == (0, 1)
    assert everything.window_ms == (-5.0, 10.0)
    empty = breakdown(_hand_made(), iterations=[7])
    assert empty.devices == {} and empty.bubble == 0.0 and empty.span_ms == 0.0
    assert breakdown([]).to_dict()["devices"] == {}


def test_to_dict_is_plain_json_data() -> None:
    import json

    data = breakdown(_hand_made(), iterations=[1]).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["devices"]["0"]["exposed_ms_by_kind"] == {"act_up": 1.0}
    assert data["window_ms"] == 8.0


def test_the_report_is_frozen() -> None:
    report = breakdown(_hand_made(), iterations=[1])
    with pytest.raises(AttributeError):
        report.bubble = 0.0  # type: ignore[misc]
    assert isinstance(report, TraceBreakdown)


def _simulated(link_gbps: float | None) -> Trace:
    # Layers of 64 MiB each: at 2 GB/s an upload (~34 ms) outlasts a 2 ms stage.
    costs = LayerCosts((1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 2.0), (64 << 20,) * 4)
    plan = partition(costs, 2, 4, async_optimizer=True)
    return simulate(
        plan, costs, 2, 4, 3, True, link_gbps, act_bytes=8 << 20, optimizer_ms=0.5, latency_ms=0.0
    ).trace


def test_a_slow_link_is_exposed_and_free_transfers_are_not() -> None:
    slow = breakdown(_simulated(2.0), iterations=[1, 2])
    free = breakdown(_simulated(None), iterations=[1, 2])
    assert slow.exposed_transfer > 0.1
    assert free.exposed_transfer == pytest.approx(0.0, abs=1e-9)
    for device in slow.devices.values():
        assert 0.0 < device.exposed_transfer <= device.bubble + 1e-9
        assert device.exposed_ms_by_kind.get("param_up", 0.0) > 0.0


def test_bubble_agrees_with_the_trace_over_the_same_window() -> None:
    trace = _simulated(2.0)
    report = breakdown(trace)
    assert report.bubble == pytest.approx(trace.bubble_ratio().overall)
    for device, ratio in trace.bubble_ratio().per_device.items():
        assert report.devices[device].bubble == pytest.approx(ratio)


def test_module_does_not_import_torch() -> None:
    source = Path(__file__).parents[1] / "roundpipe" / "sched" / "breakdown.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported
