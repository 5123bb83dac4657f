"""The training loop behind `roundpipe train`, usable from Python as `train(TrainConfig(...))`.

Why apart from the CLI: a notebook, a test or a service should run exactly the loop the command
runs (same model building, data order, learning-rate schedule, checkpoints, output files) without
going through argv, and the CLI should stay a thin layer of parsing and printing. Everything the
user sees goes through a `Reporter`, so the loop itself never prints.

Resume is exact because every input of step ``s`` is a function of the options and ``s``: the
batch comes from `roundpipe.data.batch_at` (seeded by step), the learning rate from `lr_factor`,
the weights, optimizer, scheduler and RNG state from the checkpoint. Ctrl-C (SIGINT) and SIGTERM
only set a flag (`roundpipe.train.signals`): the current step finishes, then a checkpoint is saved
at a step boundary. Where the run writes is decided and checked before the model is built
(`roundpipe.train.rundir`). The loop must never swallow an error silently nor leave the pipe open.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roundpipe.checkpoint import export_pretrained, load_checkpoint, read_checkpoint_meta, save_checkpoint
from roundpipe.errors import ConfigError
from roundpipe.faults import fault_point
from roundpipe.optim.distributed import several_processes
from roundpipe.pipe import RoundPipe
from roundpipe.train.board import LOSS_CURVE_FILE, MetricsSink, check_report_to, plot_losses
from roundpipe.train.config import TrainConfig
from roundpipe.train.data import TrainData, data_path, prepare_data
from roundpipe.train.evaluate import evaluate
from roundpipe.train.keep import non_finite_message, non_finite_weight, preserve_before_save
from roundpipe.train.model import build_model, build_tokenizer
from roundpipe.train.result import NullReporter, Reporter, TrainResult
from roundpipe.train.rundir import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    plan_outputs,
    prepare_run_dir,
    run_dir,
    saved_elapsed,
)
from roundpipe.train.signals import StopRequest, stop_on_signals

TRACE_FILE = "trace.json"
SCHEDULE_FILE = "schedule.json"  # the same trace in roundpipe's format: `roundpipe trace check|replay`
TIMELINE_FILE = "timeline.png"
NON_FINITE_PREFIX = "non-finite-step-"  # --save-non-finite: the bad state, kept apart


# --------------------------------------------------------------------- pieces


def lr_factor(config: TrainConfig, step: int) -> float:
    """Multiplier of ``config.lr`` for the optimizer step with 0-based index ``step``: linear
    warmup, then a cosine from 1 down to ``min_lr_ratio`` at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _make_optimizer(config: TrainConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    return make


def _make_scheduler(config: TrainConfig) -> Callable[[torch.optim.Optimizer], Any]:
    def make(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(config, step))

    return make


# --------------------------------------------------------------------- the loop


def train(config: TrainConfig, *, reporter: Reporter | None = None) -> TrainResult:
    """Train as ``config`` says; return what happened. Raises `roundpipe` errors for bad input
    (output locations included) before any work starts. See docs/train.md."""
    reporter = reporter or NullReporter()
    if several_processes():
        raise ConfigError(
            "roundpipe train runs as one process: sharding its data by rank is not done yet, so every "
            "process would train on the same data and write the same run directory; launch it without "
            "torchrun, or drive RoundPipe from your own script under torchrun (docs/distributed.md)"
        )
    tensorboard = check_report_to(config.report_to)
    tokenizer = build_tokenizer(config)
    data = prepare_data(config, tokenizer)
    resume_meta = read_checkpoint_meta(config.resume) if config.resume else None
    resume_step = int(resume_meta["data_step"]) if resume_meta is not None else None
    if resume_step is not None and resume_step >= config.steps:
        raise ConfigError(
            f"the checkpoint {config.resume} is at step {resume_step} and --steps is {config.steps}: "
            "nothing to do; pass a larger --steps to train further, or export it with "
            f"'roundpipe export {config.resume} DIR'"
        )
    place = plan_outputs(config, resume_step)
    # The resolved name is saved, so resuming this run's checkpoint writes into its directory.
    config = config.model_copy(update={"name": place.out_dir.name})
    model = build_model(config, tokenizer)
    pipe = RoundPipe(
        model,
        optimizer=_make_optimizer(config),
        config=config.run_config(),
        lr_scheduler=_make_scheduler(config),
    )
    with pipe:
        if config.resume:
            start = load_checkpoint(pipe, config.resume).data_step
        else:
            torch.manual_seed(config.seed)
            random.seed(config.seed)
            start = 0
        # Only now that the model, the pipe and the checkpoint are known to be good.
        prepare_run_dir(place, start if config.resume else None)
        model_info = {
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": pipe.host.trainable_numel(),
            "layers": len(pipe.host.layers),
        }
        reporter.start(config, place.out_dir, start, model_info)
        for note in [*data.notes, *place.notes]:
            reporter.note(note)
        inputs = RunInputs(data, tokenizer, tensorboard)
        return _run(pipe, config, inputs, start, place.out_dir, reporter, saved_elapsed(resume_meta))


class _Progress:
    """What the step loop, the metrics log and the checkpoint writer share during `_run`."""

    def __init__(
        self,
        pipe: RoundPipe,
        config: TrainConfig,
        start: int,
        out_dir: Path,
        reporter: Reporter,
        elapsed_offset: float,
        metrics: MetricsSink,
    ) -> None:
        self.pipe = pipe
        self.config = config
        self.start = start
        self.step = start  # optimizer steps completed
        self.checkpoint_dir = out_dir / CHECKPOINT_DIR
        self.reporter = reporter
        self.elapsed_offset = elapsed_offset
        self.losses: list[float] = []
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.metrics = metrics
        self.non_finite: str | None = None  # why it stopped, once loss or weights are not finite
        self.eval_batches: list[dict[str, torch.Tensor]] = []
        self.evaluated_at: int | None = None
        self.last_eval: dict[str, Any] | None = None

    def stop_non_finite(self, what: str, step: int | None = None) -> None:
        """Stop without saving over the last good checkpoint; with ``--save-non-finite`` the bad
        state goes aside, under a name `--resume` and `--keep-checkpoints` never pick up."""
        self.non_finite = non_finite_message(
            what, self.step if step is None else step, self.config.precision, self.last_good()
        )
        self.reporter.note(self.non_finite)
        if self.config.save_non_finite:
            aside = self.checkpoint_dir.parent / f"{NON_FINITE_PREFIX}{self.step}"
            save_checkpoint(self.pipe, aside, data_step=self.step, extra={"non_finite": self.non_finite})
            self.reporter.note(f"the non-finite state is saved in {aside} for inspection (not for --resume)")

    def check_finite(self, loss: float) -> bool:
        """False (and the run stopped) when the loss or the last gradient norm is NaN/inf."""
        if not math.isfinite(loss):
            self.stop_non_finite(f"loss is {loss}")
            return False
        bad_norm = self.pipe.runtime.non_finite_grad_norm
        if bad_norm is not None:
            self.stop_non_finite(f"gradient norm is {bad_norm[1]}", bad_norm[0])
            return False
        return True

    def last_good(self) -> Path | None:  # the newest complete checkpoint to continue from
        if (self.checkpoint_dir / "meta.json").is_file():
            return self.checkpoint_dir
        return Path(self.config.resume) if self.config.resume else None

    def log(self, done: int, loss: float) -> None:
        """One line of metrics.jsonl (and one report) for the step ``done`` just completed."""
        now = time.perf_counter()
        record = {
            "step": done,
            "loss": loss,
            "tokens_per_s": self.config.tokens_per_step / max(now - self.last, 1e-9),
            "lr": self.config.lr * lr_factor(self.config, done - 1),
            "elapsed": self.elapsed_offset + now - self.t0,
        }
        self.last = now
        self.losses.append(loss)
        self.metrics.write(record)
        self.reporter.step(record)

    def evaluate(self) -> None:
        """Evaluate on the eval set (if any) at the current step; one line of metrics.jsonl."""
        if not self.eval_batches or self.evaluated_at == self.step:
            return
        record = evaluate(self.pipe, self.eval_batches, self.step)
        self.evaluated_at = self.step
        self.last_eval = record
        self.metrics.write(record)
        report = getattr(self.reporter, "evaluation", None)
        if report is not None:
            report(record)

    def save(self) -> Path | None:
        """Save into ``checkpoint`` (keeping older ones as configured); None, and nothing
        written, when a trainable weight is no longer finite (see `non_finite`)."""
        bad = non_finite_weight(self.pipe)
        if bad is not None:
            self.stop_non_finite(f"trainable weight {bad} is not finite")
            return None
        extra = {
            "train_config": self.config.model_dump(mode="json"),
            "elapsed": self.elapsed_offset + time.perf_counter() - self.t0,
        }
        preserve_before_save(self.checkpoint_dir, self.config.keep_checkpoints, self.step)
        return save_checkpoint(self.pipe, self.checkpoint_dir, data_step=self.step, extra=extra)


@dataclass
class RunInputs:
    """The data and the tokenizer of a run (the tokenizer is exported with the model)."""

    data: TrainData
    tokenizer: Any
    tensorboard: bool = False


def _run(
    pipe: RoundPipe,
    config: TrainConfig,
    inputs: RunInputs,
    start: int,
    out_dir: Path,
    reporter: Reporter,
    elapsed_offset: float = 0.0,
) -> TrainResult:
    """Steps ``start`` .. ``config.steps``; ``elapsed_offset`` is the time the resumed run had
    already spent, so ``elapsed`` in metrics.jsonl keeps counting across a resume."""
    stop = StopRequest()
    files: dict[str, Path] = {"metrics": out_dir / METRICS_FILE}
    with stop_on_signals(stop, reporter), open(files["metrics"], "a", encoding="utf-8") as log:
        metrics = MetricsSink(log, out_dir, inputs.tensorboard)
        progress = _Progress(pipe, config, start, out_dir, reporter, elapsed_offset, metrics)
        progress.eval_batches = inputs.data.eval_batches
        interrupted = _steps(progress, inputs.data.batches(start), stop) or stop.is_set()
        pipe.synchronize()
        if not progress.non_finite and pipe.runtime.non_finite_grad_norm is not None:
            progress.check_finite(0.0)  # the last step's norm, known only now (async optimizer)
        if not interrupted and not progress.non_finite:
            progress.evaluate()  # the end of the run: always, when there is an eval set
        elapsed = time.perf_counter() - progress.t0
        metrics.close()
        bubble, notes = _write_trace_files(pipe, out_dir, files)
        last_good = progress.last_good() if progress.non_finite else progress.save() or progress.last_good()
        if last_good is not None:
            files["checkpoint"] = last_good
        if config.export and not interrupted and not progress.non_finite:
            files["export"] = export_pretrained(pipe, config.export, inputs.tokenizer)
    step = progress.step
    result = TrainResult(
        out_dir=out_dir,
        start_step=start,
        steps=step,
        losses=progress.losses,
        tokens_per_s=(step - start) * config.tokens_per_step / elapsed if elapsed > 0 else 0.0,
        bubble_ratio=bubble,
        elapsed_s=elapsed,
        checkpoint=last_good,
        files=files,
        notes=notes,
        interrupted=interrupted,
        non_finite=progress.non_finite,
        stop_signal=stop.signal.name if stop.signal is not None else None,
        eval_loss=progress.last_eval["eval_loss"] if progress.last_eval else None,
    )
    reporter.finish(result)
    return result


def _steps(progress: _Progress, batches: Iterator[dict[str, torch.Tensor]], stop: StopRequest) -> bool:
    """Train until ``config.steps``, a stop request or a non-finite loss; True when a
    KeyboardInterrupt cut it short."""
    pipe, config = progress.pipe, progress.config
    loss: float | None = None
    try:
        while progress.step < config.steps and not stop.is_set():
            loss = None
            loss = pipe.forward_backward(next(batches), None, None)
            fault_point("step", progress.step + 1)
            pipe.step()
            progress.step += 1
            progress.log(progress.step, loss)
            if not progress.check_finite(loss):
                break
            if config.eval_every and progress.step % config.eval_every == 0:
                progress.evaluate()
            if config.save_every and progress.step % config.save_every == 0 and progress.step < config.steps:
                if progress.save() is None:
                    break
    except KeyboardInterrupt:
        # Raised outside our handler (another thread's signal set-up, or code of the caller's):
        # bring the pipe to a step boundary so the checkpoint is still exact.
        settled = _settle(pipe, progress.step)
        if loss is not None and len(progress.losses) < settled - progress.start:  # ran, not logged
            progress.log(settled, loss)
        progress.step = settled
        return True
    return False


def _write_trace_files(pipe: RoundPipe, out_dir: Path, files: dict[str, Path]) -> tuple[float, list[str]]:
    """The trace as Perfetto JSON, in roundpipe's format, and as a timeline picture (when
    matplotlib is there); adds them to ``files``. Returns the bubble ratio and notes."""
    notes: list[str] = []
    trace = pipe.trace()
    bubble = float(trace.bubble_ratio().overall)
    files["trace"] = trace.to_perfetto(out_dir / TRACE_FILE)
    files["schedule"] = trace.save(out_dir / SCHEDULE_FILE)
    try:
        files["timeline"] = trace.plot(out_dir / TIMELINE_FILE)
        files["loss_curve"] = plot_losses(files["metrics"], out_dir / LOSS_CURVE_FILE)
    except ImportError as exc:
        notes.append(f"no {TIMELINE_FILE} nor {LOSS_CURVE_FILE}: {exc}")
    return bubble, notes


def _settle(pipe: RoundPipe, step: int) -> int:
    """After a KeyboardInterrupt anywhere in a step: let in-flight work finish and, if the step's
    forward_backward already ran, apply its optimizer step. Returns the steps completed."""
    pipe.synchronize()
    # One forward_backward per step here: the iteration count tells whether step `step`'s ran.
    iterations = pipe.iteration_count
    if pipe.step_count == step and iterations == step + 1:
        pipe.step()
        pipe.synchronize()
    return pipe.step_count


__all__ = [
    "CHECKPOINT_DIR",
    "METRICS_FILE",
    "TIMELINE_FILE",
    "TRACE_FILE",
    "NullReporter",
    "Reporter",
    "TrainResult",
    "build_model",
    "data_path",
    "lr_factor",
    "run_dir",
    "train",
]
