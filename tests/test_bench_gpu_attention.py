"""`bench/gpu_attention.py` on CPU at its tiny shape: one JSON line per result, each printed once
and the same lines appended to ``--out``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_attention


def test_a_cpu_smoke_run_prints_each_line_once_and_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "attention.jsonl"
    argv = ["gpu_attention.py", "--device", "cpu", "--shapes", "tiny", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    gpu_attention.main()
    printed = [json.loads(t) for t in capsys.readouterr().out.splitlines() if t.startswith("{")]
    assert printed == [json.loads(t) for t in out.read_text().splitlines()]
    measured = [line for line in printed if "backend" in line]
    assert sorted(line["backend"] for line in measured) == sorted(gpu_attention.BACKENDS)
    assert printed[0]["torch"] and printed[1] == {
        "bench": "gpu_attention",
        "shape": "tiny",
        "default": printed[1]["default"],
    }
