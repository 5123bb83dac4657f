"""Trace views: the Perfetto JSON, the PNG timeline and the ASCII grid, on a small simulated run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import partition
from roundpipe.planning.simulate import simulate
from roundpipe.sched.export import explain_violation, format_grid, lane_rows, task_label, write_perfetto
from roundpipe.sched.rules import RuleViolation
from roundpipe.sched.task import DEVICE_LANES
from roundpipe.sched.trace import Trace


@pytest.fixture(scope="module")
def trace() -> Trace:
    costs = LayerCosts.uniform(4, fwd_ms=1.0, bwd_ms=2.0, mem_bytes=1 << 20, head_factor=2.0)
    plan = partition(costs, 2, 4)
    result = simulate(
        plan, costs, 2, 4, iterations=2, async_optimizer=False, link_gbps=10.0, optimizer_ms=0.5
    )
    assert len(result.trace) > 0
    return result.trace


def _perfetto(trace: Trace, tmp_path: Path) -> dict:
    path = write_perfetto(trace, tmp_path / "out" / "t.perfetto.json")
    assert path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # temp file renamed away
    with open(path) as f:
        return json.load(f)


def test_perfetto_has_one_named_track_per_lane_per_device(trace: Trace, tmp_path: Path) -> None:
    doc = _perfetto(trace, tmp_path)
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    processes = {
        e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(processes.values()) == ["device 0", "device 1", "host"]
    threads = {
        (processes[e["pid"]], e["args"]["name"]): e["tid"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    expected = {
        ("host" if t.device < 0 else f"device {t.device}", t.lane.split(".", 1)[1]) for t in trace.records
    }
    assert set(threads) == expected
    assert len(threads) == len(set(trace.lanes()))
    # Lanes sorted compute, act_up, act_down, param_up, grad_down within each device.
    for device in ("device 0", "device 1"):
        present = [lane for lane in DEVICE_LANES if (device, lane) in threads]
        assert present[0] == "compute"
        assert [threads[(device, lane)] for lane in present] == sorted(
            threads[(device, lane)] for lane in present
        )
    sort_keys = {e["name"] for e in events if e["ph"] == "M"}
    assert {"process_sort_index", "thread_sort_index"} <= sort_keys


def test_perfetto_events_match_the_trace_in_microseconds(trace: Trace, tmp_path: Path) -> None:
    doc = _perfetto(trace, tmp_path)
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(trace)
    by_key = {tuple(t.key): t for t in trace.records}
    for event in complete:
        assert event["dur"] >= 0
        task = by_key[tuple(event["args"]["key"])]
        assert event["ts"] == pytest.approx(task.start_t * 1000.0, abs=1e-3)
        assert event["dur"] == pytest.approx((task.end_t - task.start_t) * 1000.0, abs=1e-3)
        assert event["cat"] == task.kind
        assert event["name"] == task_label(task)
        assert event["args"]["iteration"] == task.iteration
        assert event["args"]["microbatch"] == task.microbatch
    compute = next(e for e in complete if e["cat"] == "compute")
    assert compute["name"].split()[1].startswith("mb")
    upload = next(e for e in complete if e["cat"] == "param_up")
    assert upload["name"].startswith("param_up F") or upload["name"].startswith("param_up B")
    assert " L" in upload["name"]


def test_png_written(trace: Trace, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = trace.plot(tmp_path / "t.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_grid_shows_stages_idle_cells_and_the_marked_task(trace: Trace) -> None:
    grid = format_grid(trace, width=60)
    rows = [line for line in grid.splitlines() if line.lstrip().startswith("d") and "|" in line]
    assert [r.split("|")[0].strip() for r in rows] == ["d0.compute", "d1.compute"]
    cells = "".join(r.split("|")[1] for r in rows)
    assert len(rows[0].split("|")[1]) == 60
    assert "." in cells  # fill and drain are idle
    assert "F" in cells and "B" in cells
    assert "!" not in cells

    task = next(t for t in trace.records if t.kind == "param_up")
    marked = format_grid(trace, mark=task.key, width=60)
    assert "!" in marked
    assert "d0.param_up" in marked or "d1.param_up" in marked  # its lane is added
    assert task.describe() in marked
    assert format_grid(trace, mark=task, width=60) == marked


def test_lane_rows_order(trace: Trace) -> None:
    rows = lane_rows(trace)
    assert rows[-1][0] == -1  # the host last
    assert rows[0] == (0, "d0.compute")
    assert [lane for _, lane in lane_rows(trace, ("compute",))] == ["d0.compute", "d1.compute"]


def test_explain_violation_marks_the_first_task(trace: Trace) -> None:
    compute = next(t for t in trace.records if t.kind == "compute" and t.iteration == 1)
    violation = RuleViolation("dependency", "made up for the test", [compute])
    text = explain_violation(trace, violation)
    assert text.splitlines()[0] == str(violation)
    assert "!" in text
    assert f"! {compute.describe()}" in text
    check = Trace([], {})
    assert "empty" in format_grid(check)
