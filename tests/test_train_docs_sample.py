"""docs/train.md's sample output is a real run's (docs/sample_train.py writes it): its lines keep
the shape of what `roundpipe train` prints now, and its JSON the keys of the summary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from roundpipe.cli import main

REPO = Path(__file__).resolve().parents[1]
# Rows that depend on the run's options or hardware, not on the output's format.
OPTIONAL_ROWS = {"fresh layers", "GPU waiting on host", "eval loss", "rows filled", "exported model"}


def sample_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sample_train", REPO / "docs" / "sample_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_sample_has_the_shape_of_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = sample_module()
    doc = (REPO / "docs" / "train.md").read_text(encoding="utf-8")
    documented = sample.sample_block(doc)
    assert len(documented) > 5
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(sample.WIDTH))
    args = ["train", "--steps", "2", "--devices", "cpu:1", "--batch-size", "4", "--microbatches", "2"]
    assert main([*args, "--seq-len", "16", "--json"]) == 0
    out = capsys.readouterr()
    printed = [line for line in out.err.splitlines() if line.strip()]
    shapes = {sample.shape(line) for line in printed}
    for line in documented:
        if sample.table_label(line) is None and not line.lstrip().startswith(("┌", "└", "│")):
            assert sample.shape(line) in shapes, f"docs/train.md sample line not printed any more: {line!r}"
    rows = {label for line in printed if (label := sample.table_label(line))}
    documented_rows = {label for line in documented if (label := sample.table_label(line))}
    assert documented_rows - OPTIONAL_ROWS == rows - OPTIONAL_ROWS
    summary = json.loads(out.out.strip().splitlines()[-1])
    documented_json = json.loads("\n".join(sample.sample_block(doc, sample.JSON_BEGIN)))
    assert set(documented_json) == set(summary)
