"""The batches `roundpipe train` feeds the pipe, from ``--data`` and the run's tokenizer.

Why apart from the loop: which file becomes which batches (a text stream cut into windows, or
records turned into examples) is a decision about data, and the loop only asks for the batch of a
step. Every batch is a function of (options, tokenizer, step), so a resumed run sees exactly the
batches an uninterrupted one would have seen. Nothing here builds a model or touches the pipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roundpipe.data.text import CORPUS_PATH, DataFileNotFoundError, batch_at, load_text
from roundpipe.errors import ConfigError
from roundpipe.train.config import TrainConfig


@dataclass
class TrainData:
    """What the loop needs from the data: the batch of each step, and the evaluation batches."""

    batch: Any  # (step) -> dict of [batch, seq_len] tensors
    eval_batches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def batches(self, start_step: int) -> Iterator[dict[str, torch.Tensor]]:
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def data_path(config: TrainConfig) -> Path:
    """The file to train on; an existing file is required (never a literal string)."""
    if config.data is None:
        return CORPUS_PATH
    return existing_file(config.data, "--data")


def existing_file(value: str, option: str) -> Path:
    path = Path(value).expanduser()
    if not path.exists():
        raise DataFileNotFoundError(f"{option} {value!r}: no such file")
    if not path.is_file():
        raise ConfigError(f"{option} {value!r} is not a file")
    return path


def stream_tokens(path: Path, tokenizer: Any) -> torch.Tensor:
    """The whole text of ``path`` as one stream of token ids (no special tokens)."""
    ids = tokenizer.encode(load_text(str(path)), add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def stream_data(config: TrainConfig, path: Path, tokenizer: Any) -> TrainData:
    """Windows of ``seq_len`` tokens at seeded random offsets of the text (loss on every token)."""
    tokens = stream_tokens(path, tokenizer)
    if tokens.numel() < config.seq_len + 1:
        raise ConfigError(
            f"{path}: the text has {tokens.numel()} tokens but --seq-len {config.seq_len} needs at least "
            f"{config.seq_len + 1}; use a longer text or a smaller --seq-len"
        )

    def batch(step: int) -> dict[str, torch.Tensor]:
        return batch_at(tokens, step, config.seq_len, config.batch_size, config.seed)

    return TrainData(batch)


def prepare_data(config: TrainConfig, tokenizer: Any) -> TrainData:
    """The run's data, checked before any model is built."""
    return stream_data(config, data_path(config), tokenizer)


__all__ = ["TrainData", "data_path", "existing_file", "prepare_data", "stream_tokens"]
