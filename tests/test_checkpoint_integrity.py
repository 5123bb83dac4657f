"""Damaged checkpoints are refused with the file named; a NaN run keeps its last good checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roundpipe.checkpoint.manifest import MANIFEST_FILE, ManifestMissingError, verify_checkpoint
from roundpipe.cli import main
from roundpipe.errors import CheckpointError
from roundpipe.train.keep import non_finite_message
from tests.helpers import train_args


@pytest.fixture(scope="module")
def good(good_checkpoint: Path) -> Path:
    """A 2-step async run's checkpoint (it has in-flight weights too): conftest's, shared."""
    return good_checkpoint


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def overwrite_block(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same size, different bytes: only the hash can tell
        f.seek(size // 2)
        f.write(b"\xff" * min(4096, size // 4))


DAMAGE = {
    "truncated weights": ("weights.safetensors", truncate, "size"),
    "truncated in-flight weights": ("in_flight_weights.safetensors", truncate, "size"),
    "overwritten training state": ("training_state.pt", overwrite_block, "sha256"),
    "deleted rng state": ("rng_state.pt", lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(
    kind: str, good: Path, model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, damage, what = DAMAGE[kind]
    copy = tmp_path / "checkpoint"
    shutil.copytree(good, copy)
    damage(copy / name)
    capsys.readouterr()

    with pytest.raises(CheckpointError, match=f"{name}.*{what}"):
        verify_checkpoint(copy)
    assert main(["checkpoint", "verify", str(copy)]) == 2
    err = capsys.readouterr().err
    assert name in err and err.count("\n") == 1 and "Traceback" not in err

    assert main(["train", "--resume", str(copy), "--steps", "3", "--out", str(tmp_path), "--name", "r"]) == 2
    err = capsys.readouterr().err
    assert name in err and err.startswith("roundpipe: error:") and "Traceback" not in err
    assert not (tmp_path / "r" / "checkpoint").exists()  # nothing trained, nothing saved


def test_good_checkpoint_verifies_and_resumes_exactly(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_args(model_config, tmp_path, "full", 4, "--save-every", "2")) == 0
    middle = tmp_path / "full" / "checkpoint-2"  # the step-2 save, kept by --keep-checkpoints 2
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(middle)]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    copy = tmp_path / "copy"
    shutil.copytree(middle, copy)
    assert main(["train", "--resume", str(copy), "--out", str(tmp_path), "--name", "resumed"]) == 0
    full = load_file(str(tmp_path / "full" / "checkpoint" / "weights.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "checkpoint" / "weights.safetensors"))
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)


def test_checkpoint_without_manifest_loads_with_a_warning(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "old"
    shutil.copytree(good, copy)
    (copy / MANIFEST_FILE).unlink()
    with pytest.raises(ManifestMissingError):
        verify_checkpoint(copy)
    assert main(["checkpoint", "verify", str(copy)]) == 2
    assert f"{MANIFEST_FILE} is missing" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="loading it unverified"):
        code = main(["train", "--resume", str(copy), "--steps", "3", "--out", str(tmp_path), "--name", "r"])
    assert code == 0


def test_unreadable_manifest_is_refused(good: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ck"
    shutil.copytree(good, copy)
    (copy / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{MANIFEST_FILE} is unreadable"):
        verify_checkpoint(copy)


def finite(checkpoint: Path) -> bool:
    weights = load_file(str(checkpoint / "weights.safetensors"))
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


@pytest.mark.parametrize("mode", ["--sync", "--async"])
def test_nan_stops_without_replacing_the_last_good_checkpoint(
    mode: str, model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A learning rate of 1e8 makes the weights NaN within a few steps, the way a real run diverges.
    run = [*train_args(model_config, tmp_path, "nan", 8, "--save-every", "1", mode, "--json"), "--lr", "1e8"]
    assert main(run) == 3
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["steps"] < 8 and summary["checkpoint"] == str(tmp_path / "nan" / "checkpoint")
    message = summary["non_finite"]
    assert "learning rate" in message and "--precision fp32" not in message  # this run is fp32
    assert message in out.err and "Traceback" not in out.err
    checkpoint = tmp_path / "nan" / "checkpoint"
    assert finite(checkpoint) and verify_checkpoint(checkpoint) > 0
    # The last good checkpoint loads and continues (diverging again: its weights are already huge).
    saved_step = json.loads((checkpoint / "meta.json").read_text())["data_step"]
    resume = ["train", "--resume", str(checkpoint), "--out", str(tmp_path), "--name", "again", "--json"]
    assert main(resume) in (0, 3)
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["start_step"] == saved_step
    assert "Traceback" not in out.err


def test_hint_fits_the_precision() -> None:
    assert "--precision fp32" not in non_finite_message("loss is nan", 5, "fp32", None)
    assert "bf16 overflowed (try --precision fp32)" in non_finite_message("loss is nan", 5, "bf16", None)


def test_keep_checkpoints_keeps_the_newest(model_config: Path, tmp_path: Path) -> None:
    assert (
        main(train_args(model_config, tmp_path, "k", 4, "--save-every", "1", "--keep-checkpoints", "2")) == 0
    )
    run = tmp_path / "k"
    kept = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint"))
    assert kept == ["checkpoint", "checkpoint-3"]
    assert json.loads((run / "checkpoint-3" / "meta.json").read_text())["data_step"] == 3
    assert verify_checkpoint(run / "checkpoint-3") > 0 and verify_checkpoint(run / "checkpoint") > 0
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary leftovers
