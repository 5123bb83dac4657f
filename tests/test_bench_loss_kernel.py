"""bench/loss_kernel_gpu.py's smoke run on a CPU: every variant runs and agrees with eager (its
times are left to the bench)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_variant_runs_and_gives_eagers_loss_and_gradient(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "loss_kernel_gpu.py"
    spec = importlib.util.spec_from_file_location("loss_kernel_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--rows", "48", "--vocab", "1000", "--repeats", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["variant"] for x in lines] == ["eager", "compiled_dynamic", "compiled_static"]
    for line in lines:
        assert (line["rows"], line["vocab"]) == (48, 1000) and line["ms"] > 0
        assert line["loss_diff"] < 1e-4 and line["grad_max_diff"] < 1e-6
