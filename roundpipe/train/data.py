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

from roundpipe.data.batching import ExampleBatches
from roundpipe.data.examples import is_records_file, load_examples
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


def example_data(config: TrainConfig, path: Path, tokenizer: Any) -> TrainData:
    """Records (jsonl, json, parquet, csv) as examples, padded or packed into rows."""
    examples = load_examples(
        path,
        tokenizer,
        fields=config.fields,
        train_on_inputs=config.train_on_inputs,
        max_len=config.seq_len,
        truncation=config.truncation,
    )
    pad = getattr(tokenizer, "pad_token_id", None)
    if not isinstance(pad, int):
        pad = getattr(tokenizer, "eos_token_id", None)
    batches = ExampleBatches(
        examples,
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        seed=config.seed,
        pad_id=pad if isinstance(pad, int) else 0,
        packing=config.packing,
    )
    trainable = sum(e.trainable for e in examples)
    rows = f", packed into {batches.rows_per_epoch()} rows" if config.packing else ""
    note = f"{path}: {len(examples)} examples{rows}, {trainable} tokens with loss"
    return TrainData(batches.batch, notes=[note])


def prepare_data(config: TrainConfig, tokenizer: Any) -> TrainData:
    """The run's data, checked before any model is built: a text file is one stream of tokens,
    a file of records (.jsonl, .json, .parquet, .csv) a list of examples."""
    path = data_path(config)
    if is_records_file(path):
        return example_data(config, path, tokenizer)
    return stream_data(config, path, tokenizer)


__all__ = ["TrainData", "data_path", "existing_file", "prepare_data", "stream_tokens"]
