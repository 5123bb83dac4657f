"""Training runs: the loop behind `roundpipe train`, its options, and how it reports.

It exists so the main job can be driven from Python exactly as from the command line:
``train(TrainConfig(steps=50))`` builds the model, trains it through a `RoundPipe`, writes the run
directory (metrics, trace, timeline, checkpoint) and returns a `TrainResult`. Importing this
package must stay cheap and must not import torch (``roundpipe --help`` builds its parser from
here): the loop, which needs torch, is imported on first use (tests/test_layering.py imports this
package with torch blocked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from roundpipe.train.config import TrainConfig, make_config, read_config_file

if TYPE_CHECKING:
    from roundpipe.train.trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "make_config", "read_config_file", "train"]


def __getattr__(name: str) -> Any:
    # `train` and `TrainResult` pull in torch; load them only when asked for.
    if name in ("train", "TrainResult"):
        from roundpipe.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'roundpipe.train' has no attribute {name!r}")
