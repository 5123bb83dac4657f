"""`roundpipe trace gaps`: each idle gap of a compute lane and why its next compute waited.

A hand-made trace pins each classification (issued late, queued behind another task on the lane,
waited for a dependency, moving bytes); the one-device E-shaped scenario of `test_upload_order`
shows the case that finding was made from: without uploads in run order, an input queued behind
the next run's input, which waited for an activation still being computed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from roundpipe.cli.main import main
from roundpipe.sched.gaps import find_gaps, format_gaps, gap_causes
from roundpipe.sched.task import ACT_DOWN, ACT_UP, COMPUTE, PARAM_UP, Task
from tests.test_upload_order import _run


def _task(
    key: str, kind: str, lane: str, start: float, end: float, *, issue: float = -1.0, deps=(), **kw
) -> Task:
    task = Task((key,), kind, f"d0.{lane}", deps=[(d,) for d in deps], device=0, iteration=0, **kw)
    task.start_t, task.end_t, task.issue_t = start, end, issue
    return task


def _hand_made() -> list[Task]:
    """Computes c0 [0, 10] then c1 [20, 30], c2 [40, 50], c3 [60, 70], c4 [80, 90]; c1's input was
    issued late, c2's queued behind another upload that waited for an activation, c3's waited for
    its activation, c4's weights were still moving."""
    return [
        _task("c0", COMPUTE, "compute", 0, 10, issue=0, slot=0, microbatch=0),
        _task("up1", ACT_UP, "act_up", 19, 20, issue=15, slot=0, microbatch=1),
        _task("c1", COMPUTE, "compute", 20, 30, issue=0, deps=["up1"], slot=0, microbatch=1),
        _task("down", ACT_DOWN, "act_down", 30, 39, issue=5, slot=0, microbatch=1),
        _task("other", ACT_UP, "act_up", 39, 39.5, issue=5, deps=["down"], slot=1, microbatch=0),
        _task("up2", ACT_UP, "act_up", 39.5, 40, issue=6, slot=0, microbatch=2),
        _task("c2", COMPUTE, "compute", 40, 50, issue=0, deps=["up2"], slot=0, microbatch=2),
        _task("down3", ACT_DOWN, "act_down", 50, 59, issue=6, slot=0, microbatch=2),
        _task("up3", ACT_UP, "act_up", 59, 60, issue=7, deps=["down3"], slot=0, microbatch=3),
        _task("c3", COMPUTE, "compute", 60, 70, issue=0, deps=["up3"], slot=0, microbatch=3),
        _task("w", PARAM_UP, "param_up", 65, 80, issue=8, slot=1, layers=range(1, 2)),
        _task("c4", COMPUTE, "compute", 80, 90, issue=0, deps=["w"], slot=1, microbatch=0),
    ]


def test_each_gap_names_what_its_next_compute_waited_for() -> None:
    gaps = {gap.next_task.key[0]: gap for gap in find_gaps(_hand_made(), iterations=[0])}
    assert sorted(gaps) == ["c1", "c2", "c3", "c4"]
    assert [late.why for late in gaps["c1"].late] == ["issued late"]
    (behind,) = gaps["c2"].late
    assert behind.why == "behind" and behind.cause is not None and behind.cause.key == ("other",)
    assert "act_down" in behind.cause_why and "+0.00" in behind.cause_why  # it waited for the activation
    (waited,) = gaps["c3"].late
    assert waited.why == "waited for" and waited.cause is not None and waited.cause.key == ("down3",)
    (moving,) = gaps["c4"].late
    assert moving.why == "moving"
    assert gap_causes(list(gaps.values())) == {
        "act_up: issued late": 10.0,
        "act_up: behind": 10.0,
        "act_up: waited for": 10.0,
        "weights": 10.0,
    }
    text = format_gaps(list(gaps.values()), _hand_made(), window_ms=90.0)
    assert text.startswith("4 gaps, 40.0 ms of 90.0 ms (44.4%)")
    assert "its stage's weights, 1 of 1 parts late: the upload ran -5.00 to +10.00 ms" in text


def test_without_uploads_in_run_order_an_input_waits_behind_the_next_runs() -> None:
    unordered, _ = _run(in_order=False)
    blocked = [
        late
        for gap in find_gaps(unordered)
        for late in gap.late
        if late.why == "behind" and late.cause is not None and late.cause.slot != late.task.slot
    ]
    assert blocked and all(late.task.kind in (ACT_UP, "grad_up") for late in blocked)
    ordered, _ = _run(in_order=True)
    inputs_behind = [
        late
        for gap in find_gaps(ordered)
        for late in gap.late
        if late.why == "behind" and late.task.kind != PARAM_UP
    ]
    assert not inputs_behind


def test_the_command_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, _ = _run(in_order=False)
    path = trace.save(tmp_path / "trace.json")
    assert main(["trace", "gaps", str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("iterations 3, 4: ") and " ms on device 0 before " in out
    assert main(["trace", "summary", str(path)]) == 0
    assert "idle gaps per iteration (the last two) by cause: " in capsys.readouterr().out
