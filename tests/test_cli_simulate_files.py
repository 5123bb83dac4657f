"""`roundpipe simulate`'s files: a flag without a path writes under runs/simulate/, never into the
working directory, and the timeline names every compute bar's stage, backward and recompute too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roundpipe.cli import main
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import partition
from roundpipe.planning.simulate import simulate
from roundpipe.sched.export import _draw_stage_names
from roundpipe.sched.task import COMPUTE_KINDS, RECOMPUTE


def test_file_flags_without_a_path_write_under_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    argv = ["simulate", "--example", "tiny", "-n", "2", "-m", "4", "--png", "--trace", "--perfetto"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == [
        "runs/simulate/tiny-2d-4mb.perfetto.json",
        "runs/simulate/tiny-2d-4mb.png",
        "runs/simulate/tiny-2d-4mb.trace.json",
    ]
    assert "runs/simulate/tiny-2d-4mb.png" in out  # says where it went
    assert main(["simulate", "--example", "tiny", "-n", "2", "-m", "4", "--png", "here.png"]) == 0
    assert (tmp_path / "here.png").is_file()  # a path given is a path kept


class _Axes:
    """Records the labels drawn (text and rotation) instead of drawing them."""

    def __init__(self) -> None:
        self.labels: list[tuple[float, str, float]] = []

    def text(self, x: float, y: float, label: str, **kwargs: Any) -> None:
        self.labels.append((x, label, kwargs.get("rotation", 0)))


def test_backward_and_recompute_bars_carry_their_stage() -> None:
    costs = LayerCosts.uniform(12, fwd_ms=1.0, bwd_ms=2.0, mem_bytes=1 << 20, head_factor=2.0)
    plan = partition(costs, 4, 8)
    trace = simulate(plan, costs, 4, 8, iterations=2, async_optimizer=True, link_gbps=10.0).trace
    computes = [t for t in trace.records if t.kind in COMPUTE_KINDS and t.end_t > t.start_t]
    span = max(t.end_t for t in computes) - min(t.start_t for t in computes)
    rows = {(t.device, t.lane): t.device for t in computes}
    ax = _Axes()
    _draw_stage_names(ax, computes, rows, span)
    named = {(round((t.start_t + t.end_t) / 2, 9), t.stage) for t in computes}
    drawn = {(round(x, 9), label) for x, label, _ in ax.labels}
    assert drawn <= named
    backward = {t.stage for t in computes if t.stage.startswith("B")}
    assert len(backward) >= 2 and backward <= {label for _, label, _ in ax.labels}
    recomputes = {round((t.start_t + t.end_t) / 2, 9) for t in computes if t.kind == RECOMPUTE}
    assert recomputes and recomputes & {x for x, _ in drawn}
