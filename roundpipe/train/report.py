"""What `roundpipe train` shows a person: a live progress bar and the closing summary table.

Why separate from the loop: the loop reports through the small `Reporter` protocol, so Python
callers get no output unless they ask for it, and ``--json`` can send all of this to stderr while
stdout carries only the JSON line. This module must never change the run; it only draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from roundpipe.train.config import TrainConfig

if TYPE_CHECKING:
    from roundpipe.train.result import TrainResult


def _human(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _where(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class RichReporter:
    """Draws on ``console``: a header line, a progress bar with step, loss, tokens/s and ETA,
    notes, and the summary table."""

    def __init__(self, console: Console, *, progress: bool = True) -> None:
        self.console = console
        self.show_progress = progress
        self._progress: Progress | None = None
        self._task: Any = None
        self._smoothed: float | None = None

    def start(self, config: TrainConfig, out_dir: Path, start_step: int, model_info: dict[str, Any]) -> None:
        lora = f", LoRA r={config.lora_r}" if config.lora_r else ""
        trainable = model_info["trainable"]
        self.console.print(
            f"[bold]roundpipe train[/]: {config.model}{lora} ({_human(model_info['parameters'])} parameters, "
            f"{_human(trainable)} trainable, {model_info['layers']} layers) on {config.devices}, "
            f"{'async' if config.async_optimizer else 'sync'} optimizer, {config.precision}; "
            f"batch {config.batch_size}x{config.seq_len} tokens in {config.microbatches} microbatches",
            soft_wrap=True,
        )
        if start_step:
            self.console.print(f"resuming at step {start_step} from {config.resume}", soft_wrap=True)
        self.console.print(f"writing to {_where(out_dir)}/", soft_wrap=True)
        if not self.show_progress:
            return
        self._progress = Progress(
            TextColumn("[bold blue]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss [bold]{task.fields[loss]}"),
            TextColumn("{task.fields[eval]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train", total=config.steps, completed=start_step, loss="-", tps="-", eval=""
        )

    def step(self, record: dict[str, Any]) -> None:
        if self._progress is None:
            return
        # Smoothed tokens/s: a single step's rate jumps with the optimizer overlap.
        rate = float(record["tokens_per_s"])
        self._smoothed = rate if self._smoothed is None else 0.8 * self._smoothed + 0.2 * rate
        self._progress.update(
            self._task,
            completed=record["step"],
            loss=f"{record['loss']:.4f}",
            tps=f"{self._smoothed:,.0f}",
        )

    def evaluation(self, record: dict[str, Any]) -> None:
        text = f"eval {record['eval_loss']:.4f} (ppl {record['eval_perplexity']:.1f})"
        if self._progress is not None:
            self._progress.update(self._task, eval=text)
        else:
            self.console.print(f"step {record['step']}: {text}", soft_wrap=True)

    def note(self, message: str) -> None:
        # Escaped: a message may hold brackets ("pip install 'roundpipe[plot]'") rich would eat as markup.
        self.console.print(f"[yellow]{escape(message)}[/]", soft_wrap=True)

    def finish(self, result: TrainResult) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        table = Table(title="roundpipe train: summary", show_header=False, title_justify="left")
        table.add_column("what", style="bold")
        table.add_column("value", overflow="fold")
        if result.losses:
            table.add_row("loss", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
        if result.eval_loss is not None:
            table.add_row("eval loss", f"{result.eval_loss:.4f} (perplexity {result.eval_perplexity:.2f})")
        steps = f"{result.steps}"
        if result.start_step:
            steps += f" (resumed at {result.start_step})"
        if result.interrupted:
            steps += " [yellow](interrupted)[/]"
        table.add_row("steps", steps)
        rate = f"{result.tokens_per_s:,.0f}"
        if result.steady_tokens_per_s is not None:
            rate = f"{result.steady_tokens_per_s:,.0f} after the first step ({rate} over the whole run)"
        table.add_row("tokens/s", rate + ", padding left out" if _padded(result) else rate)
        if _padded(result):
            table.add_row("rows filled", f"{result.fill:.0%} of the token slots hold real tokens")
        table.add_row("bubble ratio", f"{result.bubble_ratio:.1%}")
        if result.fresh_layers:
            table.add_row("fresh layers", ", ".join(map(str, result.fresh_layers)) + " (staleness 0)")
        if result.recompute_grain == "layer_input":  # every recompute leaves out its frozen tail
            table.add_row("recompute", "every layer from its saved input (recompute_grain layer_input)")
        if result.host_bound is not None:
            # GPU time spent running kernels as the host issued them: larger microbatches help
            table.add_row("GPU waiting on host", f"{result.host_bound:.1%}")
        table.add_row("time", f"{result.elapsed_s:.1f} s")
        labels = {
            "metrics": "metrics",
            "trace": "trace (ui.perfetto.dev)",
            "schedule": "schedule (roundpipe trace)",
            "timeline": "timeline",
            "loss_curve": "loss curve",
            "checkpoint": "checkpoint",
            "export": "exported model",
        }
        for key, label in labels.items():
            if key in result.files:
                table.add_row(label, _where(result.files[key]))
        self.console.print(table)
        for note in result.notes:
            self.note(note)


def _padded(result: TrainResult) -> bool:
    return result.fill is not None and result.fill < 1.0


__all__ = ["RichReporter"]
