"""What `roundpipe train` prints: notes keep their brackets (they are text, not markup)."""

from __future__ import annotations

from rich.console import Console

from roundpipe.train.report import RichReporter


def test_notes_show_brackets_as_written() -> None:
    console = Console(record=True, width=120, color_system=None)
    RichReporter(console, progress=False).note("a timeline needs matplotlib: pip install 'roundpipe[plot]'")
    assert "pip install 'roundpipe[plot]'" in console.export_text()
