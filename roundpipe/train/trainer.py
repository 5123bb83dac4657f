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
(`roundpipe.train.rundir`). Under torchrun every process runs this loop on its share of each
global batch and rank 0 alone writes (`roundpipe.train.ranks`). The step loop itself is
`roundpipe.train.steps`. The loop must never swallow an
error silently nor leave the pipe open.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roundpipe.checkpoint import export_pretrained, load_checkpoint, read_checkpoint_meta
from roundpipe.errors import ConfigError, RoundPipeError
from roundpipe.pipe import RoundPipe
from roundpipe.quiet import quiet_libraries
from roundpipe.settings_advice import microbatch_advice, simulated_ms
from roundpipe.train.board import LOSS_CURVE_FILE, MetricsSink, check_report_to, plot_losses
from roundpipe.train.config import TrainConfig
from roundpipe.train.data import TrainData, data_path, existing_file, prepare_data
from roundpipe.train.lr_schedule import lr_factor, make_optimizer, make_scheduler
from roundpipe.train.model import build_model, build_tokenizer
from roundpipe.train.preflight import check_model
from roundpipe.train.progress import NON_FINITE_PREFIX, NoMetrics, Progress, open_metrics
from roundpipe.train.ranks import RankNotes, Ranks, make_ranks
from roundpipe.train.result import NullReporter, Reporter, TrainResult
from roundpipe.train.rundir import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    RunPlace,
    plan_outputs,
    prepare_run_dir,
    run_dir,
    saved_elapsed,
)
from roundpipe.train.signals import StopRequest, stop_on_signals
from roundpipe.train.steps import loss_lag, steps_agreed

TRACE_FILE = "trace.json"
SCHEDULE_FILE = "schedule.json"  # the same trace in roundpipe's format: `roundpipe trace check|replay`
TIMELINE_FILE = "timeline.png"


def rank_trace_file(rank: int) -> str:
    """The Perfetto trace of rank ``rank`` > 0 under torchrun (rank 0's is `TRACE_FILE`)."""
    return f"trace.rank{rank}.json"


# --------------------------------------------------------------------- the loop


@dataclass
class RunInputs:
    """The data and the tokenizer of a run (the tokenizer is exported with the model)."""

    data: TrainData
    tokenizer: Any
    tensorboard: bool = False
    resume_meta: dict[str, Any] | None = None
    place: RunPlace | None = None  # decided by the writer only


def train(config: TrainConfig, *, reporter: Reporter | None = None) -> TrainResult:
    """Train as ``config`` says; return what happened. Raises `roundpipe` errors for bad input
    (output locations included) before any work starts. Under torchrun (``WORLD_SIZE`` > 1)
    every process calls it with the same options; see docs/train.md and docs/distributed.md."""
    reporter = reporter or NullReporter()
    ranks = make_ranks(config)
    try:
        if not ranks.writer:
            reporter = RankNotes(reporter, ranks.rank)
        return _train(config, reporter, ranks)
    finally:
        ranks.close()


def _prepare(config: TrainConfig, ranks: Ranks) -> RunInputs:
    """Everything checked before the model is built, cheapest first, so that a mistyped option is
    reported before the data is read: options, model, files, checkpoint, outputs, then the data."""
    tensorboard = check_report_to(config.report_to)
    facts = check_model(config)
    data_path(config)  # a missing --data file, before any tokenizing
    if config.eval_data is not None:
        existing_file(config.eval_data, "--eval-data")
    resume_meta = read_checkpoint_meta(config.resume) if config.resume else None
    resume_step = int(resume_meta["data_step"]) if resume_meta is not None else None
    if resume_step is not None and resume_step >= config.steps:
        raise ConfigError(
            f"the checkpoint {config.resume} is at step {resume_step} and --steps is {config.steps}: "
            "nothing to do; pass a larger --steps to train further, or export it with "
            f"'roundpipe export {config.resume} DIR'"
        )
    place = plan_outputs(config, resume_step) if ranks.writer else None
    tokenizer = build_tokenizer(config)
    inputs = RunInputs(prepare_data(config, tokenizer, facts.max_positions), tokenizer, tensorboard)
    inputs.resume_meta, inputs.place = resume_meta, place
    return inputs


def _train(config: TrainConfig, reporter: Reporter, ranks: Ranks) -> TrainResult:
    error: BaseException | None = None
    try:
        inputs = _prepare(config, ranks)
    except (RoundPipeError, OSError, ValueError, ImportError) as exc:
        error = exc
    ranks.check_setup(error, config)  # every process raises, or none does
    out_dir = Path(ranks.from_writer(str(inputs.place.out_dir) if inputs.place else None))
    # The resolved name and length are saved, so a resume writes into this run's directory and
    # cuts the data as this run did.
    config = config.model_copy(update={"name": out_dir.name, "seq_len": inputs.data.seq_len})
    with quiet_libraries():  # roundpipe's progress display is the only one
        model = build_model(config, inputs.tokenizer, reporter)
    ranks.barrier()  # built everywhere: building the pipe is a collective timed by --dist-timeout
    pipe = RoundPipe(
        model,
        optimizer=make_optimizer(config),
        # planned for the loop that runs: under torchrun each loss is read before the next step
        config=config.run_config().model_copy(update={"loss_lag": loss_lag(config, ranks)}),
        lr_scheduler=make_scheduler(config),
    )
    with pipe:
        if config.resume:
            start = load_checkpoint(pipe, config.resume).data_step
        else:
            torch.manual_seed(config.seed)
            random.seed(config.seed)
            start = 0
        # Only now that the model, the pipe and the checkpoint are known to be good.
        if inputs.place is not None:
            prepare_run_dir(inputs.place, start if config.resume else None)
        model_info = {
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": pipe.host.trainable_numel(),
            "layers": len(pipe.host.layers),
        }
        reporter.start(config, out_dir, start, model_info)
        if pipe.runtime.compiler.enabled:
            # Nothing else is shown until the first step ends, which on a fresh machine is long.
            reporter.note(
                "the first step compiles the layers (torch.compile) and measures them: up to a "
                "minute or two on a fresh machine, less once the compile cache is warm"
            )
        rows = config.batch_size // ranks.world if config.batch_size % ranks.world == 0 else None
        simulated = simulated_ms(pipe.costs, pipe.num_devices, config.async_optimizer)
        advice = microbatch_advice(config.microbatches, pipe.num_devices, rows, ms_per_microbatch=simulated)
        for note in [
            *inputs.data.notes,
            *(inputs.place.notes if inputs.place else []),
            *([advice] if advice else []),
        ]:
            reporter.note(note)
        elapsed = saved_elapsed(inputs.resume_meta)
        return _run(pipe, config, inputs, start, out_dir, reporter, ranks, elapsed)


def _run(
    pipe: RoundPipe,
    config: TrainConfig,
    inputs: RunInputs,
    start: int,
    out_dir: Path,
    reporter: Reporter,
    ranks: Ranks,
    elapsed_offset: float = 0.0,
) -> TrainResult:
    """Steps ``start`` .. ``config.steps``; ``elapsed_offset`` is the time the resumed run had
    already spent, so ``elapsed`` in metrics.jsonl keeps counting across a resume."""
    stop = StopRequest()
    files: dict[str, Path] = {"metrics": out_dir / METRICS_FILE} if ranks.writer else {}
    log = open_metrics(out_dir / METRICS_FILE, ranks)
    with stop_on_signals(stop, reporter), log or nullcontext():
        metrics = MetricsSink(log, out_dir, inputs.tensorboard) if log is not None else NoMetrics()
        progress = Progress(pipe, config, start, out_dir, reporter, elapsed_offset, metrics, ranks)
        progress.eval_batches = inputs.data.eval_batches
        progress.real_tokens = inputs.data.real_tokens
        interrupted = steps_agreed(progress, inputs.data.batches(start), stop) or stop.is_set()
        if not progress.non_finite and pipe.runtime.non_finite_grad_norm is not None:
            progress.check_finite(0.0)  # the last step's norm, known only now (async optimizer)
        if not interrupted and not progress.non_finite:
            progress.evaluate()  # the end of the run: always, when there is an eval set
        elapsed = time.perf_counter() - progress.t0
        metrics.close()
        bubble, notes = _write_trace_files(pipe, out_dir, files, ranks)
        facts = _pipe_facts(pipe)
        last_good = progress.last_good() if progress.non_finite else progress.save() or progress.last_good()
        if last_good is not None:
            files["checkpoint"] = last_good
        if config.export and not interrupted and not progress.non_finite:
            if ranks.writer:
                files["export"] = export_pretrained(pipe, config.export, inputs.tokenizer)
            ranks.barrier()
    step = progress.step
    result = TrainResult(
        out_dir=out_dir,
        start_step=start,
        steps=step,
        losses=progress.losses,
        tokens_per_s=progress.tokens / elapsed if elapsed > 0 else 0.0,
        fill=progress.fill(),
        steady_tokens_per_s=progress.steady_tokens_per_s(),
        bubble_ratio=bubble,
        **facts,
        elapsed_s=elapsed,
        checkpoint=last_good,
        files=files,
        notes=notes,
        interrupted=interrupted,
        non_finite=progress.non_finite,
        stop_signal=stop.signal.name if stop.signal is not None else None,
        eval_loss=progress.last_eval["eval_loss"] if progress.last_eval else None,
        rank=ranks.rank,
    )
    reporter.finish(result)
    return result


def _pipe_facts(pipe: RoundPipe) -> dict[str, Any]:
    """What the pipe chose and saw, for `TrainResult`: the layers that read fresh weights, the
    recompute grain, and the trace's host-bound share (None when no task was issued ahead of its
    completion)."""
    from roundpipe.sched.breakdown import breakdown

    facts: dict[str, Any] = {
        "fresh_layers": tuple(sorted(pipe.fresh_units)),
        "recompute_grain": pipe.runtime.recompute_grain,
        "host_bound": None,
    }
    trace = pipe.trace()
    if any(t.issue_t >= 0 and t.kind in ("compute", "recompute") for t in trace):
        facts["host_bound"] = breakdown(trace).host_bound
    return facts


def _write_trace_files(
    pipe: RoundPipe, out_dir: Path, files: dict[str, Path], ranks: Ranks
) -> tuple[float, list[str]]:
    """The trace as Perfetto JSON, in roundpipe's format, and as a timeline picture (when
    matplotlib is there); adds them to ``files``. Returns the bubble ratio and notes. A process
    other than the writer writes its Perfetto trace only (`rank_trace_file`), for
    ``roundpipe trace merge``."""
    notes: list[str] = []
    trace = pipe.trace()
    bubble = float(trace.bubble_ratio().overall)
    if not ranks.writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        files["trace"] = trace.to_perfetto(out_dir / rank_trace_file(ranks.rank))
        return bubble, notes
    files["trace"] = trace.to_perfetto(out_dir / TRACE_FILE)
    files["schedule"] = trace.save(out_dir / SCHEDULE_FILE)
    try:
        files["timeline"] = trace.plot(out_dir / TIMELINE_FILE)
        files["loss_curve"] = plot_losses(files["metrics"], out_dir / LOSS_CURVE_FILE)
    except ImportError as exc:
        notes.append(f"no {TIMELINE_FILE} nor {LOSS_CURVE_FILE}: {exc}")
    return bubble, notes


__all__ = [
    "CHECKPOINT_DIR",
    "METRICS_FILE",
    "NON_FINITE_PREFIX",
    "TIMELINE_FILE",
    "TRACE_FILE",
    "NullReporter",
    "Reporter",
    "TrainResult",
    "build_model",
    "data_path",
    "lr_factor",
    "rank_trace_file",
    "run_dir",
    "train",
]
