"""Where a run's numbers go besides the progress line: metrics.jsonl, TensorBoard, a loss curve.

Why one place: every metrics record (a step's loss, learning rate and speed, or an evaluation)
must reach metrics.jsonl (the file roundpipe reads back on resume) and, with ``--report-to
tensorboard`` (the default when the `tensorboard` package is installed), event files in the run
directory, where ``tensorboard --logdir runs`` finds them next to other runs. At the end the
curve of metrics.jsonl, resumed steps included, is drawn as loss.png beside the timeline.

It must never change what is trained, and a missing optional package is a note, never a crash,
unless the user asked for TensorBoard by name (then the run stops before it starts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from roundpipe.errors import ConfigError

LOSS_CURVE_FILE = "loss.png"
SCALARS = {  # metrics.jsonl key -> TensorBoard tag
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


def check_report_to(report_to: str) -> bool:
    """Whether the run writes TensorBoard events; raises when it was asked for and cannot."""
    if report_to == "none":
        return False
    available = tensorboard_available()
    if report_to == "tensorboard" and not available:
        raise ConfigError(
            "--report-to tensorboard: the tensorboard package is not installed "
            "(pip install 'roundpipe[tensorboard]', or pass --report-to none)"
        )
    return available


class MetricsSink:
    """Appends records to metrics.jsonl and, when enabled, to TensorBoard events in ``out_dir``."""

    def __init__(self, metrics: IO[str], out_dir: Path, tensorboard: bool) -> None:
        self.metrics = metrics
        self.writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(out_dir))

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.writer is None:
            return
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def plot_losses(metrics_file: Path, target: Path) -> Path:
    """The training loss (and eval loss, when there is one) of ``metrics_file`` over steps, as a
    PNG; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        json.loads(line) for line in metrics_file.read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for key, label, style in (("loss", "train", "-"), ("eval_loss", "eval", "o-")):
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=label, markersize=4)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"loss: {metrics_file.parent.name}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(target, dpi=100)
    finally:
        plt.close(fig)
    return target


__all__ = ["LOSS_CURVE_FILE", "MetricsSink", "check_report_to", "plot_losses", "tensorboard_available"]
