"""`roundpipe train` as several processes (torchrun's variables, gloo, ``--devices cpu:1`` each).

What must hold: two processes, each on its half of every global batch, train exactly what one
process trains on the whole batch (sync, and async with the default remedies; fp32: weights and
losses to rtol 1e-5); rank 0 alone
writes the run directory and the other writes only its trace; a SIGTERM on rank 1 stops both after
the same step, with the checkpoint of that step, and a NaN loss on rank 1 stops both at that
step, keeping the last good checkpoint; one process resumes from the two processes'
checkpoint at the same data position; a rank that hangs makes the other exit non-zero within the
timeout, naming it; and ``torchrun --max-restarts 1`` resumes from the last checkpoint after a rank
was killed. Each run serves several tests, and its processes start before the test run's first
test (tests/distributed_train_runs.py), since starting a process costs seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from roundpipe import faults
from roundpipe.cli import main
from tests.distributed_train_runs import HANG_TIMEOUT_S, Started, collect
from tests.helpers import checkpoint_data_step, metrics_logged


def weights(checkpoint: Path, file: str = "weights.safetensors") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / file))


def assert_same_weights(actual: Path, expected: Path, file: str = "weights.safetensors") -> None:
    a, b = weights(actual, file), weights(expected, file)
    assert a.keys() == b.keys() and b, file
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def runs(distributed_train_runs: Started | None, model_config: Path) -> dict[str, Any]:
    """The runs' outcomes: two processes stopped by a SIGTERM on rank 1 at step 3; one process on
    the whole batch for 5 steps (a checkpoint at each, run here); two processes whose rank 1 hangs
    in step 2; two whose rank 1 has a NaN loss at step 3; the torchrun job whose rank 1 is killed.
    The processes were started at the test run's start (tests/distributed_train_runs.py)."""
    assert distributed_train_runs is not None, "tests/conftest.py starts them for the selected tests"
    return collect(distributed_train_runs, model_config)


def test_two_processes_train_what_one_trains_on_the_global_batch(runs: dict[str, Any]) -> None:
    out = runs["out"]
    (_, log0, _), (_, log1, _) = runs["two"]
    assert runs["one"] == 0
    assert_same_weights(out / "two" / "checkpoint", out / "one" / "checkpoint-3")
    two, one = metrics_logged(out / "two"), metrics_logged(out / "one")
    assert [r["step"] for r in two] == [1, 2, 3]  # rank 0's log: the global loss of every step
    for mine, theirs in zip(two, one, strict=False):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert mine["tokens_per_s"] > 0
    # One writer: rank 0's run directory, and rank 1's Perfetto trace beside it; rank 1 is quiet.
    assert (out / "two" / "trace.json").is_file() and (out / "two" / "trace.rank1.json").is_file()
    assert "writing to" in log0 and "summary" in log0
    assert "writing to" not in log1 and "summary" not in log1 and "{" not in log1, log1


def test_two_asynchronous_processes_train_what_one_trains_on_the_global_batch(runs: dict[str, Any]) -> None:
    """Staleness 1 with weight prediction and the lr ramp, through the command line: two processes
    averaging each step's gradients on the optimizer lane equal one process on the whole batch."""
    out = runs["out"]
    assert runs["one-async"] == 0
    assert [code for code, _, _ in runs["two-async"]] == [0, 0], runs["two-async"]
    assert_same_weights(out / "two-async" / "checkpoint", out / "one-async" / "checkpoint")
    two, one = metrics_logged(out / "two-async"), metrics_logged(out / "one-async")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4]
    for mine, theirs in zip(two, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    # The asynchronous steps' weights in flight are part of the checkpoint, on both sides alike.
    assert_same_weights(
        out / "two-async" / "checkpoint", out / "one-async" / "checkpoint", "in_flight_weights.safetensors"
    )


def test_a_signal_on_one_rank_stops_both_after_the_same_step(runs: dict[str, Any]) -> None:
    (code0, log0, _), (code1, log1, _) = runs["two"]
    assert (code0, code1) == (143, 143), log0 + log1
    assert "rank 1 received SIGTERM: every process stops after step 3" in log0, log0
    assert json.loads(log0.strip().splitlines()[-1])["stop_signal"] == "SIGTERM"
    assert checkpoint_data_step(runs["out"] / "two" / "checkpoint") == 3


def test_a_nan_loss_on_one_rank_stops_both_at_that_step_keeping_the_last_good_checkpoint(
    runs: dict[str, Any],
) -> None:
    (code0, log0, _), (code1, log1, _) = runs["nan"]
    assert (code0, code1) == (3, 3), log0 + log1
    assert "loss is nan at step 3; stopped without saving" in log0, log0
    assert [r["step"] for r in metrics_logged(runs["out"] / "nan")] == [1, 2, 3]
    assert checkpoint_data_step(runs["out"] / "nan" / "checkpoint") == 2


def test_one_process_resumes_a_two_process_checkpoint_at_the_same_data_step(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = runs["out"]
    shutil.copytree(out / "two", out / "resumed")
    argv = [
        "train",
        "--resume",
        str(out / "resumed" / "checkpoint"),
        "--name",
        "resumed",
        "--steps",
        "5",
        "--json",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["start_step"] == 3
    assert_same_weights(out / "resumed" / "checkpoint", out / "one" / "checkpoint")
    resumed, one = metrics_logged(out / "resumed"), metrics_logged(out / "one")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for mine, theirs in zip(resumed[3:], one[3:], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)


def test_a_hung_rank_makes_the_other_fail_within_the_timeout_naming_it(runs: dict[str, Any]) -> None:
    code, log, ended = runs["hang0"]
    assert code != 0 and "roundpipe: error: rank 0: step 2 failed" in log, log
    assert "rank 1 is behind, last seen in step 2 (forward_backward)" in log, log
    assert "--dist-timeout" in log and "Traceback" not in log
    hung_since = (runs["out"] / "hang" / "metrics.jsonl").stat().st_mtime  # step 1 logged
    assert ended - hung_since < HANG_TIMEOUT_S + 15, "rank 0 took too long to stop"


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(runs: dict[str, Any]) -> None:
    if runs["elastic"] is None:
        pytest.skip("torchrun is not installed")
    code, stdout, stderr = runs["elastic"]
    assert code == 0, stdout + stderr
    assert "restart 1 by torchrun: resuming from" in stderr, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["start_step"] == 2
    assert [r["step"] for r in metrics_logged(runs["out"] / "elastic")] == [1, 2, 3, 4]
    assert checkpoint_data_step(runs["out"] / "elastic" / "checkpoint") == 4


def test_the_ranks_traces_merge_into_one_perfetto_view(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs["out"] / "two"
    assert main(["trace", "merge", str(run)]) == 0
    assert "ranks 0, 1" in capsys.readouterr().out
    merged = json.loads((run / "trace.merged.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["rank 0: device 0", "rank 0: host", "rank 1: device 0", "rank 1: host"]
    tasks = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    per_rank = [json.loads((run / name).read_text()) for name in ("trace.json", "trace.rank1.json")]
    assert len(tasks) == sum(sum(e["ph"] == "X" for e in d["traceEvents"]) for d in per_rank)
    assert {names[e["pid"]].split(":")[0] for e in tasks} == {"rank 0", "rank 1"}


def test_fault_entries_can_name_a_rank_and_fire_in_the_first_attempt_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = "SIGTERM@step:3@rank:1,HANG@step:2@rank:0,SIGINT@save:2"
    monkeypatch.setenv("RANK", "1")
    assert faults._parse(spec) == [(faults.signal.SIGTERM, "step:3"), (faults.signal.SIGINT, "save:2")]
    monkeypatch.setenv("RANK", "0")
    assert faults._parse(spec) == [(faults.HANG, "step:2"), (faults.signal.SIGINT, "save:2")]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults._parse(spec) == []
    with pytest.raises(ValueError, match="@rank:R"):
        faults._parse("SIGKILL@step:1@rank:x")


def test_the_global_batch_must_split_into_whole_shares() -> None:
    from roundpipe.errors import ConfigError
    from roundpipe.train import TrainConfig
    from roundpipe.train.ranks import check_shares

    check_shares(TrainConfig(batch_size=8, microbatches=4), 2)
    with pytest.raises(ConfigError, match="must split evenly over the 3 processes"):
        check_shares(TrainConfig(batch_size=8, microbatches=2), 3)
    with pytest.raises(ConfigError, match="lower --microbatches to 2 or raise --batch-size to 16"):
        check_shares(TrainConfig(batch_size=8, microbatches=4), 4)
