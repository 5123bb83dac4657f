"""A run directory is accepted where a checkpoint is asked for, and a damaged checkpoint's error
names the intact older checkpoint to use instead."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from roundpipe.checkpoint import read_checkpoint_meta
from roundpipe.checkpoint.find import resolve_checkpoint
from roundpipe.cli import main
from roundpipe.errors import CheckpointError


@pytest.fixture
def run(good_checkpoint: Path, tmp_path: Path) -> Path:
    """A run directory with its latest checkpoint and one kept copy."""
    run = tmp_path / "runs" / "r"
    shutil.copytree(good_checkpoint, run / "checkpoint")
    shutil.copytree(good_checkpoint, run / "checkpoint-2")
    (run / "metrics.jsonl").write_text("")
    return run


def damage(checkpoint: Path) -> None:
    weights = checkpoint / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def test_verify_takes_a_run_directory(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoint", "verify", str(run)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"ok: {run / 'checkpoint'}"
    assert f"{run} is a run directory: using its checkpoint {run / 'checkpoint'} (step 2)" in out.err


def test_a_damaged_checkpoint_names_the_intact_one(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damage(run / "checkpoint")
    assert main(["checkpoint", "verify", str(run / "checkpoint")]) == 2
    err = capsys.readouterr().err
    assert "weights.safetensors" in err
    assert f"the older checkpoint {run / 'checkpoint-2'} (step 2) is intact: resume from it" in err
    # the run directory: its newest intact checkpoint, saying which one was passed over
    assert resolve_checkpoint(run) == (
        run / "checkpoint-2",
        f"{run} is a run directory: using its checkpoint {run / 'checkpoint-2'} (step 2); "
        f"{run / 'checkpoint'} is damaged",
    )
    damage(run / "checkpoint-2")
    with pytest.raises(CheckpointError, match="every checkpoint in it is damaged"):
        resolve_checkpoint(run)


def test_read_meta_of_a_run_directory_says_what_to_pass(run: Path) -> None:
    with pytest.raises(
        CheckpointError, match=re.escape(f"it is a run directory: pass its checkpoint, {run / 'checkpoint'}")
    ):
        read_checkpoint_meta(run)
    with pytest.raises(CheckpointError, match=r"neither a checkpoint .* nor a run directory"):
        resolve_checkpoint(run.parent)


def test_resume_takes_a_run_directory(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--resume", str(run), "--steps", "3", "--out", str(tmp_path / "more"), "--name", "m"]
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.splitlines()[-1])["start_step"] == 2
    assert f"using its checkpoint {run / 'checkpoint'}" in out.err
