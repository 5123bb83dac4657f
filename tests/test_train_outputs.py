"""Where `roundpipe train` writes: outputs checked before training, `roundpipe export`, and a
resume that never overwrites a newer run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from roundpipe.cli import main
from tests.helpers import checkpoint_data_step, metrics_logged, train_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def steps_logged(run: Path) -> list[int]:
    return [line["step"] for line in metrics_logged(run)]


@pytest.mark.parametrize("blocker", ["other files", "a file"])
def test_bad_export_target_fails_before_training(
    blocker: str, model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "hf"
    if blocker == "a file":
        target.write_text("not a directory")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    assert main([*train_args(model_config, tmp_path, "x", 50), "--export", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: --export") and str(target) in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # nothing trained, nothing written


def test_run_directory_under_a_file_fails_before_training(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "runs").write_text("a file where the runs should go")
    assert main(train_args(model_config, tmp_path / "runs", "x", 50)) == 2
    err = capsys.readouterr().err
    assert "run directory" in err and "is a file" in err and "Traceback" not in err


def test_export_command_matches_train_export(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main([*train_args(model_config, tmp_path, "e", 2, "--lora-r", "2"), "--export", str(tmp_path / "a")])
        == 0
    )
    checkpoint = tmp_path / "e" / "checkpoint"
    assert main(["export", str(checkpoint), str(tmp_path / "b")]) == 0
    assert "exported" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "adapter_model.safetensors" in files and files == sorted(
        p.name for p in (tmp_path / "b").iterdir()
    )
    weights = "adapter_model.safetensors"
    assert (tmp_path / "a" / weights).read_bytes() == (tmp_path / "b" / weights).read_bytes()
    # A finished run's checkpoint and --resume: "nothing to do" now names the export command.
    assert main(["train", "--resume", str(checkpoint)]) == 2
    assert f"roundpipe export {checkpoint} DIR" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    assert main(["export", str(checkpoint), str(tmp_path / "c")]) == 2
    assert "already holds other files" in capsys.readouterr().err


def test_resuming_an_older_copy_continues_in_a_new_run_directory(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_args(model_config, tmp_path, "r", 4, "--save-every", "2")) == 0
    run = tmp_path / "r"
    older = run / "checkpoint-2"
    newest = (run / "checkpoint" / "manifest.json").read_bytes()
    assert main(["train", "--resume", str(older), "--steps", "5", "--json"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    fresh = tmp_path / "r-from-2"
    assert summary["out_dir"] == str(fresh) and "newer than this checkpoint" in out.err
    assert (run / "checkpoint" / "manifest.json").read_bytes() == newest  # the newer run is untouched
    assert steps_logged(run) == [1, 2, 3, 4] and steps_logged(fresh) == [1, 2, 3, 4, 5]
    assert checkpoint_data_step(fresh / "checkpoint") == 5
    # Resuming the new run's own checkpoint continues there.
    assert main(["train", "--resume", str(fresh / "checkpoint"), "--steps", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out_dir"] == str(fresh)


def test_overwrite_replaces_the_newer_run_and_keeps_its_metrics_aside(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_args(model_config, tmp_path, "o", 4, "--save-every", "2")) == 0
    run = tmp_path / "o"
    copy = tmp_path / "copy-2"
    shutil.copytree(run / "checkpoint-2", copy)
    assert main(["train", "--resume", str(copy), "--steps", "3", "--overwrite"]) == 0
    assert "--overwrite" in capsys.readouterr().out
    assert checkpoint_data_step(run / "checkpoint") == 3 and steps_logged(run) == [1, 2, 3]
    replaced = (run / "metrics.replaced.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in replaced] == [3, 4]  # never cut: kept aside
    assert not (run / "checkpoint-4").exists() and checkpoint_data_step(run / "checkpoint-2") == 2
