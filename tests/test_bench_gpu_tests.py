"""bench/gpu_tests.sh: each gpu test runs in its own process under its own limit and gets a line
of its own, and tests the call's deadline leaves no time for are named as not run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ONE_TEST = "tests/test_cuda.py::test_cuda_closed_pipe_leaves_nothing_allocated"


def _run(tmp_path: Path, **env: str) -> list[str]:
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_tests.sh"), ONE_TEST],
        env={**os.environ, "OUT": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return result.stdout.splitlines()


def test_each_test_gets_its_verdict_and_the_deadline_names_what_did_not_run(tmp_path: Path) -> None:
    header, line = _run(tmp_path)
    assert header == "== 1 gpu tests, 180s each at most"
    verdict = "1 passed" if torch.cuda.is_available() else "1 skipped"
    assert line.strip().startswith(verdict) and line.endswith(f": {ONE_TEST}"), line
    assert f"===== {ONE_TEST}" in (tmp_path / "gpu_tests.log").read_text()
    _, not_run = _run(tmp_path, DEADLINE_S="10")
    assert not_run.strip().startswith("not run (") and not_run.endswith(ONE_TEST), not_run
