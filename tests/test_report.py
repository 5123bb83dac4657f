"""What `roundpipe train` prints: notes keep their brackets (they are text, not markup)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from roundpipe.train.report import RichReporter
from roundpipe.train.result import TrainResult


def test_notes_show_brackets_as_written() -> None:
    console = Console(record=True, width=120, color_system=None)
    RichReporter(console, progress=False).note("a timeline needs matplotlib: pip install 'roundpipe[plot]'")
    assert "pip install 'roundpipe[plot]'" in console.export_text()


def test_summary_shows_the_host_bound_share_only_where_it_was_measured(tmp_path: Path) -> None:
    def summary(host_bound: float | None) -> str:
        console = Console(record=True, width=120, color_system=None)
        result = TrainResult(tmp_path, 0, 2, [3.0, 2.5], 100.0, 0.1, 1.0, None, host_bound=host_bound)
        RichReporter(console, progress=False).finish(result)
        return console.export_text()

    assert "GPU waiting on host" not in summary(None)  # CPU workers: nothing is issued ahead
    assert "GPU waiting on host │ 73.0%" in summary(0.73)
    assert (
        TrainResult(tmp_path, 0, 2, [3.0], 1.0, 0.0, 1.0, None, host_bound=0.5).summary()["host_bound"] == 0.5
    )
