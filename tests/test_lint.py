"""The code stays lint-clean: ruff runs with the tests (mypy is slower; see docs/development.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e .[dev])")
def test_ruff_check_is_clean() -> None:
    result = subprocess.run(
        ["ruff", "check", "roundpipe", "tests", "bench", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
