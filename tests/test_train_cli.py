"""`roundpipe train` end to end, in-process, on a tiny model: files, --json, resume, Ctrl-C, errors."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from roundpipe.cli import main
from roundpipe.optim.host import default_optimizer
from roundpipe.pipe import RoundPipe
from roundpipe.train import TrainConfig, make_config, read_config_file
from roundpipe.train.config import DEFAULT_ASYNC_LR_RAMP_START, DEFAULT_ASYNC_LR_RAMP_STEPS
from roundpipe.train.lr_schedule import make_optimizer
from roundpipe.train.trainer import lr_factor
from tests.helpers import metrics_logged, train_args

JSON_KEYS = {"initial_loss", "final_loss", "tokens_per_s", "bubble_ratio", "steps", "out_dir"}


def tiny_args(model_config: Path, out: Path, name: str, steps: int = 4) -> list[str]:
    return [
        "train",
        "--model", str(model_config),
        "--steps", str(steps),
        "--seq-len", "16",
        "--batch-size", "4",
        "--microbatches", "2",
        "--warmup-steps", "2",
        "--lr", "3e-3",
        "--out", str(out),
        "--name", name,
    ]  # fmt: skip


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_files_and_json(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main([*tiny_args(model_config, tmp_path, "a", steps=3), "--json", "--export", str(tmp_path / "hf")])
        == 0
    )
    out = capsys.readouterr()
    summary = last_json(out.out)
    assert JSON_KEYS <= summary.keys()
    assert summary["steps"] == 3 and summary["out_dir"] == str(tmp_path / "a")
    assert summary["host_bound"] is None  # CPU workers complete each task as they issue it
    assert summary["fresh_layers"] == [1]  # one fused stage: the first block reads fresh weights
    assert summary["recompute_grain"] == "stage"  # "auto" on CPU workers
    assert summary["final_loss"] != summary["initial_loss"]  # three steps: too few to ask for a fall
    assert out.out.strip().count("\n") == 0  # --json: nothing but the JSON line on stdout
    assert "summary" in out.err  # the table went to stderr
    run = tmp_path / "a"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"step", "loss", "tokens_per_s", "lr", "elapsed"}
    assert rows[0]["loss"] == summary["initial_loss"] and rows[-1]["loss"] == summary["final_loss"]
    # The rate after the first step: the two later steps' tokens over the time they took.
    tokens = 2 * 4 * 16  # two steps of tiny_args' batch: 4 sequences of 16 tokens
    steady = tokens / (rows[2]["elapsed"] - rows[0]["elapsed"])
    assert summary["steady_tokens_per_s"] == pytest.approx(steady, rel=1e-6)
    assert json.loads((run / "trace.json").read_text())["traceEvents"]
    assert main(["trace", "check", str(run / "schedule.json")]) == 0  # the real run obeyed the rules
    assert (run / "timeline.png").read_bytes().startswith(b"\x89PNG")
    meta = json.loads((run / "checkpoint" / "meta.json").read_text())
    assert meta["data_step"] == 3 and meta["extra"]["train_config"]["name"] == "a"
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_table_output_without_json(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*tiny_args(model_config, tmp_path, "t", steps=2), "--sync", "--lora-r", "2"]) == 0
    out = capsys.readouterr().out
    for text in (
        "LoRA r=2",
        "sync optimizer",
        "loss",
        "tokens/s",
        "after the first step",
        "bubble ratio",
        "metrics.jsonl",
        "checkpoint",
    ):
        assert text in out


def interrupt_at(monkeypatch: pytest.MonkeyPatch, at_step: int, how: str) -> None:
    """Make Ctrl-C arrive while step ``at_step`` runs (a real SIGINT, or a bare KeyboardInterrupt)."""
    original = RoundPipe.step

    def step(self: RoundPipe) -> None:
        original(self)
        if self.step_count == at_step:
            if how == "signal":
                signal.raise_signal(signal.SIGINT)
            else:
                raise KeyboardInterrupt

    monkeypatch.setattr(RoundPipe, "step", step)


@pytest.fixture(scope="module")
def uninterrupted(model_config: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The metrics of the run the Ctrl-C tests cut and resume, run to the end once for both."""
    out = tmp_path_factory.mktemp("runs")
    assert main([*tiny_args(model_config, out, "full"), "--json"]) == 0
    return metrics(out / "full")


@pytest.mark.parametrize("how", ["signal", "keyboard-interrupt"])
def test_ctrl_c_saves_and_resume_continues_exactly(
    model_config: Path,
    uninterrupted: list[dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    full = uninterrupted
    interrupt_at(monkeypatch, 2, how)
    assert main([*tiny_args(model_config, tmp_path, "cut"), "--json"]) == 130
    monkeypatch.undo()
    out = capsys.readouterr()
    checkpoint = tmp_path / "cut" / "checkpoint"
    assert f"roundpipe train --resume {checkpoint}" in out.err
    assert "Traceback" not in out.err
    assert last_json(out.out)["steps"] == 2 and last_json(out.out)["interrupted"] is True
    assert json.loads((checkpoint / "meta.json").read_text())["data_step"] == 2

    # Only --resume: every other option comes from the checkpoint, output goes to the same run.
    assert main(["train", "--resume", str(checkpoint), "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    assert summary["steps"] == 4 and summary["out_dir"] == str(tmp_path / "cut")
    resumed = metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # bit-exact
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]
    assert summary["initial_loss"] == full[2]["loss"]


def test_config_file_and_flag_precedence(model_config: Path, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_config}\nseq-len: 16\nsteps: 9\nsync: true\nbatch_size: 4\n")
    values = read_config_file(path)
    assert values == {
        "model": str(model_config),
        "seq_len": 16,
        "steps": 9,
        "async_optimizer": False,
        "batch_size": 4,
    }
    (tmp_path / "run.json").write_text(json.dumps({"steps": 1, "microbatches": 2}))
    args = [*tiny_args(model_config, tmp_path, "p", steps=2), "--config", str(tmp_path / "run.json")]
    from roundpipe.cli import build_parser
    from roundpipe.cli.train_command import options

    merged = make_config(options(build_parser().parse_args(args)))
    assert merged.steps == 2 and merged.microbatches == 2  # the flag beats the file


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data", "no/such/file.txt"], "no such file"),
        (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
        (["--steps", "many"], "argument --steps: invalid int value"),
        (["--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--devices", "gpu:3"], "--devices: 'gpu:3' is not understood"),
        (["--precision", "fp8"], "--precision: Input should be 'fp32', 'bf16' or 'fp16'"),
        (["--microbatches", "64", "--batch-size", "4"], "microbatches=64 exceeds batch_size=4"),
        (["--resume", "no/such/checkpoint"], "checkpoint no/such/checkpoint does not exist"),
        (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["--weight-prediction", "-1"], "--weight-prediction: the factor of the last update must be in"),
        (["--weight-prediction", "2,x"], "--weight-prediction: '2,x' is no factor"),
        (["--async-warmup-steps", "-3"], "--async-warmup-steps: Input should be greater than or equal to 0"),
        (["--fresh-at", "1,b"], "--fresh-at: '1,b' is no layer index"),
    ],
)
def test_bad_input_exits_2_with_one_message(
    args: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roundpipe: error: ") and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing was written


def test_config_file_with_unknown_key_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nlearning_rate: 0.1\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"roundpipe: error: {path}: unknown option 'learning_rate'; known options: model")
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(
    model_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*tiny_args(model_config, tmp_path, "once", steps=1), "--json"]) == 0
    assert main([*tiny_args(model_config, tmp_path, "once", steps=1), "--json"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" not in err
    # --overwrite does not start over a finished run either, and says what it does replace
    assert main([*tiny_args(model_config, tmp_path, "once", steps=1), "--json", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite replaces only the newer checkpoints of a --resume" in err
    assert (tmp_path / "once" / "checkpoint" / "meta.json").is_file()  # nothing lost
    assert main(["train", "--resume", str(tmp_path / "once" / "checkpoint"), "--json"]) == 2
    assert "nothing to do; pass a larger --steps" in capsys.readouterr().err


def test_defaults_and_schedule() -> None:
    config = TrainConfig()
    assert (config.model, config.devices, config.async_optimizer, config.data) == (
        "qwen3-tiny",
        "cpu:2",
        True,
        None,
    )
    assert lr_factor(config, 0) == pytest.approx(1 / config.warmup_steps)
    assert lr_factor(config, config.warmup_steps) == pytest.approx(1.0)
    assert lr_factor(config, config.steps - 1) == pytest.approx(config.min_lr_ratio, abs=1e-3)


def test_the_host_optimizers_use_the_fused_cpu_kernel() -> None:
    """The optimizer copies live on the host, where torch's AdamW otherwise takes its per-tensor
    loop, 8x slower (docs/performance.md, "The host optimizer's kernel")."""
    params = [torch.zeros(4, requires_grad=True)]
    for opt in (make_optimizer(TrainConfig())(params), default_optimizer(params)):
        assert opt.defaults["fused"] is True
        params[0].grad = torch.ones(4)
        opt.step()  # the kernel runs on CPU tensors of this torch
    assert float(params[0].detach().abs().sum()) > 0


def test_async_remedy_flags_reach_the_run_config(model_config: Path, tmp_path: Path) -> None:
    from roundpipe.cli import build_parser
    from roundpipe.cli.train_command import options

    args = tiny_args(model_config, tmp_path, "r", steps=2)
    chosen = make_config(
        options(
            build_parser().parse_args(
                [
                    *args,
                    "--async-warmup-steps",
                    "3",
                    "--weight-prediction",
                    "1.5",
                    "--async-lr-ramp-steps",
                    "7",
                    "--async-lr-ramp-start",
                    "0.25",
                    "--fresh-at",
                    "2,1",
                    "--fresh-at-if-fused",
                    "none",
                ]
            )
        )
    ).run_config()
    assert chosen.fresh_at == (1, 2) and chosen.fresh_at_if_fused == ()
    assert (chosen.async_warmup_steps, chosen.weight_prediction) == (3, 1.5)
    assert (chosen.async_lr_ramp_steps, chosen.async_lr_ramp_start) == (7, 0.25)
    default = TrainConfig().run_config()  # the measured default (docs/performance.md)
    assert (default.async_warmup_steps, default.weight_prediction) == (20, (2.0, -1.0))
    assert default.fresh_at_if_fused == (1,) and default.fresh_at == ()
    assert (default.async_lr_ramp_steps, default.async_lr_ramp_start) == (
        DEFAULT_ASYNC_LR_RAMP_STEPS,
        DEFAULT_ASYNC_LR_RAMP_START,
    )


def test_a_checkpoint_saved_before_the_lr_ramp_resumes_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import roundpipe.checkpoint
    from roundpipe.cli.train_command import _saved_options

    old = {"extra": {"train_config": {"steps": 9, "async_warmup_steps": 20}}}
    monkeypatch.setattr(roundpipe.checkpoint, "read_checkpoint_meta", lambda path: old)
    assert _saved_options("ckpt")["async_lr_ramp_steps"] == 0
    new = {"extra": {"train_config": {"steps": 9, "async_lr_ramp_steps": 120}}}
    monkeypatch.setattr(roundpipe.checkpoint, "read_checkpoint_meta", lambda path: new)
    assert _saved_options("ckpt")["async_lr_ramp_steps"] == 120
    # Saved before fresh_at_if_fused existed: every layer was stale, and a resume keeps it so.
    assert _saved_options("ckpt")["fresh_at_if_fused"] == ()


def test_reading_each_loss_a_step_late_trains_the_same_run(
    model_config: Path, tmp_path: Path, capsys
) -> None:
    """``--loss-lag 1`` (the default) submits step s + 1 before reading step s's loss; every
    loss, evaluation and checkpoint is that of ``--loss-lag 0``, where the loop waits for each."""
    runs = {}
    for lag in ("0", "1"):
        extra = (
            "--eval-split",
            "0.25",
            "--eval-every",
            "2",
            "--save-every",
            "3",
            "--loss-lag",
            lag,
            "--json",
        )
        assert main(train_args(model_config, tmp_path, f"lag{lag}", 5, *extra)) == 0
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        logged = [
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed")}
            for r in metrics_logged(tmp_path / f"lag{lag}")
        ]
        runs[lag] = (logged, summary["steps"])
    assert runs["0"] == runs["1"]
    assert [r["step"] for r in runs["1"][0] if "eval_loss" in r] == [2, 4, 5]
    for checkpoint in ("checkpoint", "checkpoint-3"):
        a = (tmp_path / "lag0" / checkpoint / "weights.safetensors").read_bytes()
        assert a == (tmp_path / "lag1" / checkpoint / "weights.safetensors").read_bytes(), checkpoint


def test_no_save_residuals_reaches_the_run_config(model_config: Path, tmp_path: Path) -> None:
    from roundpipe.cli import build_parser
    from roundpipe.cli.train_command import options

    args = tiny_args(model_config, tmp_path, "r", steps=2)
    for extra, saved in (([], True), (["--no-save-residuals"], False)):
        chosen = make_config(options(build_parser().parse_args([*args, *extra]))).run_config()
        assert chosen.save_residuals is saved, extra
