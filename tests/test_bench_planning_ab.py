"""bench/planning_ab.py: two checkouts planned in turns, each in its own process.

Its figures are times (left to the bench), but its plumbing is checked here on a small grid:
the processes import the checkout they were started for, every grid shape is planned, and the
plans of two identical checkouts compare equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_planning_ab_compares_a_checkout_with_itself() -> None:
    command = [sys.executable, str(ROOT / "bench" / "planning_ab.py"), "--base", str(ROOT)]
    command += ["--loops", "late", "--rounds", "1", "--repeats", "1", "--layers", "24", "--devices", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = done.stdout.strip().splitlines()
    row = json.loads(line)
    assert (row["bench"], row["loop"], row["layers"], row["devices"]) == ("planning-ab", "late", 24, 2)
    assert row["same_plans"] is True
    for side in ("base", "this"):
        figures = row[side]["per_shape"]
        assert len(figures) == 16 and all(ms > 0 for ms in figures.values())
        assert row[side]["max_ms"] == max(figures.values())
