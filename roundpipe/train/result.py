"""What a training run returns and how it reports while it runs: `TrainResult` and `Reporter`.

Why apart from the loop: the CLI's rich reporter and anyone driving `train` from Python need
these types without pulling in torch or the loop itself. They carry data only.

This module must never import torch, and a reporter must never change what the loop does.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from roundpipe.train.config import TrainConfig


@dataclass
class TrainResult:
    """What a run did. ``losses`` are this call's steps only (a resumed run starts at
    ``start_step``); ``steps`` is the step count reached, resumed steps included."""

    out_dir: Path
    start_step: int
    steps: int
    losses: list[float]
    tokens_per_s: float
    bubble_ratio: float
    elapsed_s: float
    checkpoint: Path | None
    files: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    non_finite: str | None = None  # why the run stopped at a NaN/inf loss (nothing saved then)
    stop_signal: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped the run
    eval_loss: float | None = None  # the last evaluation's loss (None without an eval set)
    rank: int = 0  # this process's rank under torchrun (rank 0 writes the run directory)
    # Share of the run in which a GPU ran work the host was still issuing (`sched.breakdown`);
    # None where no task was issued ahead of its completion (CPU workers).
    host_bound: float | None = None
    # Tokens/s after this call's first step (None under two steps): ``tokens_per_s`` counts the
    # whole run, the first step's compiling and measuring on a GPU included.
    steady_tokens_per_s: float | None = None
    # Layers that read the newest weights (`RoundPipe.fresh_units`): which ones depends on the
    # plan for `TrainConfig.fresh_at_if_fused`, so the run says which it got.
    fresh_layers: tuple[int, ...] = ()
    # What a backward stage recomputed from (`RunConfig.recompute_grain`; "auto" chose one).
    recompute_grain: str = "stage"
    # Real tokens over token slots (padding included) of this call's steps: ``tokens_per_s``
    # counts real tokens only, so a run of half-empty rows shows both figures.
    fill: float | None = None

    @property
    def exit_code(self) -> int:
        """What `roundpipe train` exits with: 3 non-finite, 128 + signal when stopped, else 0."""
        if self.non_finite:
            return 3
        if self.stop_signal is not None:
            return 128 + int(signal.Signals[self.stop_signal])
        return 130 if self.interrupted else 0

    @property
    def initial_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    @property
    def eval_perplexity(self) -> float | None:
        if self.eval_loss is None:
            return None
        return math.exp(self.eval_loss) if self.eval_loss < 700 else float("inf")

    def summary(self) -> dict[str, Any]:
        """The JSON object `roundpipe train --json` prints."""
        return {
            "initial_loss": self.initial_loss,
            "final_loss": self.final_loss,
            "eval_loss": self.eval_loss,
            "eval_perplexity": self.eval_perplexity,
            "tokens_per_s": self.tokens_per_s,
            "steady_tokens_per_s": self.steady_tokens_per_s,
            "fill": self.fill,
            "bubble_ratio": self.bubble_ratio,
            "host_bound": self.host_bound,
            "fresh_layers": list(self.fresh_layers),
            "recompute_grain": self.recompute_grain,
            "steps": self.steps,
            "start_step": self.start_step,
            "elapsed_s": self.elapsed_s,
            "interrupted": self.interrupted,
            "non_finite": self.non_finite,
            "stop_signal": self.stop_signal,
            "out_dir": str(self.out_dir),
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "files": {k: str(v) for k, v in self.files.items()},
        }


class Reporter(Protocol):
    """Receives what a person would want to see; `roundpipe.train.report` draws it with rich."""

    def start(
        self, config: TrainConfig, out_dir: Path, start_step: int, model_info: dict[str, Any]
    ) -> None: ...
    def step(self, record: dict[str, Any]) -> None: ...
    def note(self, message: str) -> None: ...
    def evaluation(self, record: dict[str, Any]) -> None: ...
    def finish(self, result: TrainResult) -> None: ...


class NullReporter:
    """Reports nothing (the default for calls from Python)."""

    def start(self, config: TrainConfig, out_dir: Path, start_step: int, model_info: dict[str, Any]) -> None:
        pass

    def step(self, record: dict[str, Any]) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def evaluation(self, record: dict[str, Any]) -> None:
        pass

    def finish(self, result: TrainResult) -> None:
        pass
