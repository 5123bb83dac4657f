"""What the step loop of `roundpipe train` shares while it runs: the step reached, the losses, the
metrics log, evaluation and the checkpoint writer.

Why apart from the loop: these are the pieces that differ between the one process that writes
(rank 0, or the only process) and the others under torchrun, and the loop should not branch on
that at every turn. Every process takes every decision (stop on a non-finite loss or weight,
evaluate, save) from numbers all processes share, so they decide alike; only the writer writes,
and the others wait at a barrier after each save (`roundpipe.train.ranks`).

This module must never choose what is trained nor when a step runs (the loop does).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from roundpipe.checkpoint import save_checkpoint
from roundpipe.pipe import RoundPipe
from roundpipe.train.board import MetricsSink
from roundpipe.train.config import TrainConfig
from roundpipe.train.evaluate import evaluate
from roundpipe.train.keep import non_finite_message, non_finite_weight, preserve_before_save
from roundpipe.train.lr_schedule import lr_factor
from roundpipe.train.ranks import Ranks
from roundpipe.train.result import Reporter
from roundpipe.train.rundir import CHECKPOINT_DIR

NON_FINITE_PREFIX = "non-finite-step-"  # --save-non-finite: the bad state, kept apart


class NoMetrics(MetricsSink):
    """The metrics of a process that does not write (rank > 0 under torchrun)."""

    def __init__(self) -> None:
        self.writer = None

    def write(self, record: dict[str, Any]) -> None:
        pass


def open_metrics(path: Path, ranks: Ranks) -> IO[str] | None:
    """The writer's metrics.jsonl, open for appending; None on the other processes."""
    return open(path, "a", encoding="utf-8") if ranks.writer else None


class Progress:
    """The state `roundpipe.train.trainer` carries from step to step."""

    def __init__(
        self,
        pipe: RoundPipe,
        config: TrainConfig,
        start: int,
        out_dir: Path,
        reporter: Reporter,
        elapsed_offset: float,
        metrics: MetricsSink,
        ranks: Ranks,
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
        # When this call's first step was logged (``last``: its latest): the rate after the first
        # step leaves out what only the first one does (on a GPU, compiling and measuring layers).
        self.first_logged: float | None = None
        self.metrics = metrics
        self.ranks = ranks
        self.non_finite: str | None = None  # why it stopped, once loss or weights are not finite
        self.eval_batches: list[Any] = []
        # (step) -> the real (not padding) tokens of that step's batch; None: all slots are real.
        self.real_tokens: Callable[[int], int] | None = None
        self.tokens = 0  # real tokens of this call's logged steps
        self.slots = 0  # token slots (padding included) of the same steps
        self.first_tokens = 0  # real tokens of this call's first logged step
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
            if self.ranks.writer:
                save_checkpoint(self.pipe, aside, data_step=self.step, extra={"non_finite": self.non_finite})
            self.ranks.barrier()
            self.reporter.note(f"the non-finite state is saved in {aside} for inspection (not for --resume)")

    def check_finite(self, loss: float, step: int | None = None) -> bool:
        """False (and the run stopped) when the loss (of ``step``, default the last one taken)
        or the last gradient norm is NaN/inf."""
        if not math.isfinite(loss):
            self.stop_non_finite(f"loss is {loss}", step)
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
        """One line of metrics.jsonl (and one report) for the step ``done`` just completed; the
        tokens are the global batch's, so under torchrun rank 0 reports every process's."""
        now = time.perf_counter()
        slots = self.config.tokens_per_step
        tokens = slots if self.real_tokens is None else self.real_tokens(done - 1)
        self.tokens += tokens
        self.slots += slots
        record = {
            "step": done,
            "loss": loss,
            "tokens_per_s": tokens / max(now - self.last, 1e-9),  # real tokens, padding left out
            "lr": self.config.lr * lr_factor(self.config, done - 1),
            "elapsed": self.elapsed_offset + now - self.t0,
        }
        if self.real_tokens is not None:  # rows of examples: how full this step's rows were
            record["fill"] = tokens / slots
        self.last = now
        if self.first_logged is None:
            self.first_logged, self.first_tokens = now, tokens
        self.losses.append(loss)
        self.metrics.write(record)
        self.reporter.step(record)

    def steady_tokens_per_s(self) -> float | None:
        """Tokens per second from the end of this call's first step to the end of its last
        (None under two steps): what the run sustains once the first step's one-time work is
        done."""
        if self.first_logged is None or len(self.losses) < 2:
            return None
        seconds = self.last - self.first_logged
        return (self.tokens - self.first_tokens) / seconds if seconds > 0 else None

    def fill(self) -> float | None:
        """Real tokens over token slots of the logged steps (None before any step)."""
        return self.tokens / self.slots if self.slots else None

    def evaluate(self) -> None:
        """Evaluate on the eval set (if any) at the current step; one line of metrics.jsonl.
        Each process evaluates its share of the eval batches; the sums are added up."""
        if not self.eval_batches or self.evaluated_at == self.step:
            return
        ranks = self.ranks
        record = evaluate(self.pipe, self.eval_batches[ranks.rank :: ranks.world], self.step, ranks.sum)
        self.evaluated_at = self.step
        self.last_eval = record
        self.metrics.write(record)
        report = getattr(self.reporter, "evaluation", None)
        if report is not None:
            report(record)

    def save(self) -> Path | None:
        """Save into ``checkpoint`` (keeping older ones as configured); None, and nothing
        written, when a trainable weight is no longer finite (see `non_finite`). Every process
        checks the weights (they are equal); the writer saves, the others wait for it."""
        self.ranks.reached(self.step, "save")
        bad = non_finite_weight(self.pipe)
        if bad is not None:
            self.stop_non_finite(f"trainable weight {bad} is not finite")
            return None
        extra = {
            "train_config": self.config.model_dump(mode="json"),
            "elapsed": self.elapsed_offset + time.perf_counter() - self.t0,
            "processes": self.ranks.world,
        }
        path = self.checkpoint_dir
        if self.ranks.writer:
            preserve_before_save(self.checkpoint_dir, self.config.keep_checkpoints, self.step)
            path = save_checkpoint(self.pipe, self.checkpoint_dir, data_step=self.step, extra=extra)
        self.ranks.barrier()
        return path


__all__ = ["NON_FINITE_PREFIX", "NoMetrics", "Progress", "open_metrics"]
