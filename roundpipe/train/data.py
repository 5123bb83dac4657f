"""The batches `roundpipe train` feeds the pipe, from ``--data`` and the run's tokenizer.

Why apart from the loop: which file becomes which batches (a text stream cut into windows, or
records turned into examples) is a decision about data, and the loop only asks for the batch of a
step. Every batch is a function of (options, tokenizer, step), so a resumed run sees exactly the
batches an uninterrupted one would have seen. Nothing here builds a model or touches the pipe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roundpipe.data.batching import ExampleBatches, epoch_order, eval_batches
from roundpipe.data.examples import (
    Example,
    HubDataset,
    fit_length,
    is_records_file,
    load_examples,
    looks_like_hub_name,
)
from roundpipe.data.text import CORPUS_PATH, DataFileNotFoundError, batch_at, load_text
from roundpipe.errors import ConfigError
from roundpipe.train.config import TrainConfig

# A text stream has no natural length: the window the built-in corpus was tuned with.
TEXT_SEQ_LEN = 64
SEQ_LEN_GRAIN = 16  # a chosen length is a multiple of this (kernel- and compile-friendly shapes)


@dataclass
class TrainData:
    """What the loop needs from the data: the batch of each step, and the evaluation batches."""

    batch: Any  # (step) -> dict of [batch, seq_len] tensors
    eval_batches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seq_len: int = TEXT_SEQ_LEN  # the run's tokens per row (chosen here when not given)
    epoch_rows: int | None = None  # rows per pass over the training examples (None: a text stream)
    # (step) -> tokens of the step's batch that are not padding; None: every slot is a token.
    real_tokens: Callable[[int], int] | None = None

    def batches(self, start_step: int) -> Iterator[dict[str, torch.Tensor]]:
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def data_path(config: TrainConfig) -> Path | HubDataset:
    """The file to train on (never a literal string), or a dataset on the Hugging Face hub when
    no such file exists and the value is a hub name (``owner/name``)."""
    if config.data is None:
        return CORPUS_PATH
    if not Path(config.data).expanduser().exists() and looks_like_hub_name(config.data):
        return HubDataset(config.data)
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


def _seq_len(config: TrainConfig) -> int:
    if config.seq_len is None:  # prepare_data chooses it before anything below runs
        raise ConfigError("seq_len is chosen from the data when the run starts; set it first")
    return config.seq_len


def _check_length(tokens: torch.Tensor, config: TrainConfig, what: str) -> None:
    if tokens.numel() < _seq_len(config) + 1:
        raise ConfigError(
            f"{what} has {tokens.numel()} tokens but --seq-len {_seq_len(config)} needs at least "
            f"{_seq_len(config) + 1}; use a longer text, a smaller --seq-len or a smaller --eval-split"
        )


def eval_rows(config: TrainConfig) -> int:
    """Rows per evaluation call: one training microbatch, so evaluation fits where training does."""
    return max(1, config.batch_size // config.microbatches)


def window_batches(tokens: torch.Tensor, config: TrainConfig) -> list[dict[str, torch.Tensor]]:
    """Consecutive windows of ``seq_len`` tokens over all of ``tokens`` (a shorter last one is
    dropped), in batches of `eval_rows`."""
    count = tokens.numel() // _seq_len(config)
    windows = tokens[: count * _seq_len(config)].view(count, _seq_len(config))
    rows = eval_rows(config)
    return [
        {"input_ids": windows[i : i + rows], "labels": windows[i : i + rows].clone()}
        for i in range(0, count, rows)
    ]


def stream_data(config: TrainConfig, path: Path, tokenizer: Any) -> TrainData:
    """Windows of ``seq_len`` tokens at seeded random offsets of the text (loss on every token);
    ``--eval-split`` holds out the end of the text."""
    tokens = stream_tokens(path, tokenizer)
    held: list[dict[str, torch.Tensor]] = []
    if config.eval_split is not None:
        cut = tokens.numel() - int(tokens.numel() * config.eval_split)
        _check_length(tokens[cut:], config, f"--eval-split {config.eval_split} of {path}")
        held = window_batches(tokens[cut:], config)
        tokens = tokens[:cut]
    _check_length(tokens, config, str(path))

    def batch(step: int) -> dict[str, torch.Tensor]:
        return batch_at(tokens, step, _seq_len(config), config.batch_size, config.seed)

    windows = tokens.numel() / _seq_len(config)
    name = "the corpus shipped with roundpipe" if path == CORPUS_PATH else str(path)
    note = f"{name}: {tokens.numel()} tokens to train on" + epochs_note(config, windows, "windows")
    return TrainData(batch, eval_batches=held, notes=[note], seq_len=_seq_len(config))


def epochs_note(config: TrainConfig, rows: float, what: str) -> str:
    """`` (R rows of L); S steps of B rows: E epochs``, for the data's note: how often the run
    reads its data, which on a small dataset is many times."""
    epochs = config.steps * config.batch_size / max(rows, 1e-9)
    return (
        f" ({rows:,.0f} {what} of {_seq_len(config)}); {config.steps} steps of {config.batch_size} "
        f"rows: {epochs:,.1f} epochs"
    )


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _examples(config: TrainConfig, path: Path | HubDataset, tokenizer: Any) -> list[Example]:
    return load_examples(
        path,
        tokenizer,
        fields=config.fields,
        train_on_inputs=config.train_on_inputs,
        max_len=config.seq_len,
        truncation=config.truncation,
    )


def choose_seq_len(lengths: list[int], max_positions: int | None, packing: bool) -> int:
    """The sequence length for examples of these ``lengths``: the longest, rounded up to a
    multiple of `SEQ_LEN_GRAIN` (with packing, to a power of two, so that rows hold several
    examples), never beyond the model's ``max_positions``."""
    longest = max(lengths, default=TEXT_SEQ_LEN)
    length = -(-longest // SEQ_LEN_GRAIN) * SEQ_LEN_GRAIN
    if packing:
        length = max(length, 1 << (longest - 1).bit_length())
    return min(length, max_positions) if max_positions else length


def _chosen_length(
    config: TrainConfig, examples: list[Example], max_positions: int | None
) -> tuple[list[Example], int, str | None]:
    """The examples fitted to the run's length, the length, and a note when it was chosen here."""
    if config.seq_len is not None:
        return fit_length(examples, config.seq_len, config.truncation), config.seq_len, None
    lengths = [len(e.ids) for e in examples]
    seq_len = choose_seq_len(lengths, max_positions, config.packing)
    limit = f"the model's {max_positions} positions (max_position_embeddings of {config.model})"
    examples = fit_length(examples, seq_len, config.truncation, limit=limit)
    note = (
        f"--seq-len {seq_len}, chosen from the data: its longest example has {max(lengths)} tokens"
        + (f" (the model takes {max_positions})" if max_positions else "")
        + "; pass --seq-len to choose another"
    )
    return examples, seq_len, note


def example_eval_batches(
    examples: list[Example], config: TrainConfig, tokenizer: Any
) -> list[dict[str, Any]]:
    rows = eval_rows(config)
    return eval_batches(
        examples, seq_len=_seq_len(config), batch_size=rows, pad_id=_pad_id(tokenizer), packing=config.packing
    )


def example_data(
    config: TrainConfig, path: Path | HubDataset, tokenizer: Any, max_positions: int | None = None
) -> TrainData:
    """Records (jsonl, json, parquet, csv) as examples, padded or packed into rows of the run's
    length (chosen from the examples when ``--seq-len`` is not given); ``--eval-split`` holds out
    a seeded sample of them."""
    examples, seq_len, chosen = _chosen_length(
        config, _examples(config.model_copy(update={"seq_len": None}), path, tokenizer), max_positions
    )
    config = config.model_copy(update={"seq_len": seq_len})
    held: list[Example] = []
    if config.eval_split is not None:
        count = max(1, round(len(examples) * config.eval_split))
        if count >= len(examples):
            raise ConfigError(
                f"--eval-split {config.eval_split} of {len(examples)} examples in {path} leaves none to train on"
            )
        order = epoch_order(len(examples), config.seed, -1)  # an order no training epoch uses
        held = [examples[i] for i in sorted(order[:count])]
        kept = set(order[:count])
        examples = [e for i, e in enumerate(examples) if i not in kept]
    batches = ExampleBatches(
        examples,
        seq_len=seq_len,
        batch_size=config.batch_size,
        seed=config.seed,
        pad_id=_pad_id(tokenizer),
        packing=config.packing,
    )
    trainable = sum(e.trainable for e in examples)
    what = "packed rows" if config.packing else "rows"
    note = f"{path}: {len(examples)} examples, {trainable} tokens with loss" + epochs_note(
        config, batches.rows_per_epoch(), what
    )
    if held:
        note += f"; {len(held)} held out to evaluate"
    return TrainData(
        batches.batch,
        eval_batches=example_eval_batches(held, config, tokenizer),
        notes=[note] + ([chosen] if chosen else []),
        seq_len=seq_len,
        epoch_rows=batches.rows_per_epoch(),
        real_tokens=batches.real_tokens,
    )


def prepare_data(config: TrainConfig, tokenizer: Any, max_positions: int | None = None) -> TrainData:
    """The run's data, checked before any model is built: a text file is one stream of tokens,
    a file of records (.jsonl, .json, .parquet, .csv) a list of examples; the evaluation set is
    held out of it (``--eval-split``) or read from ``--eval-data`` the same way. Without
    ``--seq-len`` the length is chosen here (`TrainData.seq_len`), within ``max_positions``."""
    path = data_path(config)
    if isinstance(path, HubDataset) or is_records_file(path):
        data = example_data(config, path, tokenizer, max_positions)
    else:
        length = config.seq_len or min(TEXT_SEQ_LEN, max_positions or TEXT_SEQ_LEN)
        data = stream_data(config.model_copy(update={"seq_len": length}), path, tokenizer)
    config = config.model_copy(update={"seq_len": data.seq_len})
    if config.eval_data is not None:
        source = existing_file(config.eval_data, "--eval-data")
        if is_records_file(source):
            data.eval_batches = example_eval_batches(_examples(config, source, tokenizer), config, tokenizer)
        else:
            tokens = stream_tokens(source, tokenizer)
            _check_length(tokens, config, str(source))
            data.eval_batches = window_batches(tokens, config)
    return data


__all__ = [
    "TEXT_SEQ_LEN",
    "TrainData",
    "choose_seq_len",
    "data_path",
    "eval_rows",
    "existing_file",
    "prepare_data",
    "stream_tokens",
]
