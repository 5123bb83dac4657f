"""bench/gil_switch.py: its figures are times (left to the bench); here, that it runs and gives
the interpreter's switch interval back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gil_switch_bench_measures_and_gives_the_interval_back() -> None:
    spec = importlib.util.spec_from_file_location("gil_switch", ROOT / "bench" / "gil_switch.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = sys.getswitchinterval()
    assert bench.per_call_us(0.0005, 1, 200) > 0
    assert sys.getswitchinterval() == before
