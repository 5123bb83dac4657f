"""Byte-level text data for examples, tests and benchmarks, with no downloads.

Training a language model end to end needs a tokenizer and a stream of batches; this module gives a
byte-level tokenizer (vocabulary = the 256 byte values, plus optional special tokens after them),
readers for plain text and jsonl (one ``{"text": ...}`` object per line), and ``token_batches``,
whose batch at step ``s`` depends only on ``(text, seq_len, batch_size, seed, s)``: the data position
is the step number, so a run resumed at ``start_step`` sees exactly the batches an uninterrupted run
would have seen. It must never download anything, keep hidden global state, or use the global RNG.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from roundpipe.errors import DataError

BYTE_VOCAB = 256
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
DOC_SEPARATOR = "\n\n"


class DataFileNotFoundError(FileNotFoundError, ValueError):
    """A data file does not exist (both a ``FileNotFoundError`` and a ``ValueError``)."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; special tokens (if any) get ids 256, 257, ..."""

    def __init__(self, specials: Sequence[str] = ()) -> None:
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be unique, got {list(specials)}")
        self.specials: tuple[str, ...] = tuple(specials)
        self.special_ids: dict[str, int] = {tok: BYTE_VOCAB + i for i, tok in enumerate(self.specials)}

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(self.specials)

    def encode(self, text: str, bos: str | None = None, eos: str | None = None) -> list[int]:
        """Token ids of ``text``; ``bos``/``eos`` name special tokens to put around it."""
        ids = list(text.encode("utf-8"))
        if bos is not None:
            ids.insert(0, self.special_id(bos))
        if eos is not None:
            ids.append(self.special_id(eos))
        return ids

    def special_id(self, token: str) -> int:
        if token not in self.special_ids:
            raise ValueError(
                f"{token!r} is not a special token of this tokenizer (it has {list(self.specials)})"
            )
        return self.special_ids[token]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids``; special tokens are written as their names, invalid UTF-8 as U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        parts: list[str] = []
        run = bytearray()
        for value in values:
            if 0 <= value < BYTE_VOCAB:
                run.append(value)
                continue
            index = value - BYTE_VOCAB
            if not 0 <= index < len(self.specials):
                raise ValueError(f"token id {value} is outside the vocabulary [0, {self.vocab_size})")
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            parts.append(self.specials[index])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


def encode(text: str) -> list[int]:
    """Byte-level token ids of ``text`` (no special tokens)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int] | torch.Tensor) -> str:
    """Inverse of :func:`encode` (ids must be 0..255)."""
    return ByteTokenizer().decode(ids)


def read_jsonl(path: str | os.PathLike[str], key: str = "text") -> list[str]:
    """The ``key`` field of every line of a jsonl file (blank lines are skipped)."""
    p = _existing_file(path)
    texts: list[str] = []
    for number, record in jsonl_objects(p, _read_utf8(p)):
        if not isinstance(record.get(key), str):
            raise DataError(
                f'{p}:{number}: expected an object with a string field {key!r}, like {{"{key}": "..."}}'
            )
        texts.append(record[key])
    if not texts:
        raise DataError(f'{p} contains no records; it needs one {{"{key}": ...}} object per line')
    return texts


def jsonl_lines(text: str) -> list[tuple[int, str]]:
    """The non-blank lines of a jsonl text with their 1-based line numbers. Lines end at "\n"
    only: JSON strings may hold other line separators (U+2028) that str.splitlines would cut at."""
    return [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]


def jsonl_objects(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    """Every line of a jsonl file's ``text`` parsed as a JSON object, with its line number; a
    line that is not one is a `DataError` naming the file, the line and the reason."""
    records = []
    for number, line in jsonl_lines(text):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}: "
                f"{excerpt(line.rstrip(), exc.pos)}); each line must be one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got a {type(record).__name__}")
        records.append((number, record))
    return records


def excerpt(line: str, pos: int, width: int = 20) -> str:
    """The text around ``pos`` of a long line, quoted, so the reason is seen whole."""
    start = max(0, pos - width)
    text = line[start : pos + width]
    return ("..." if start else "") + repr(text) + ("..." if pos + width < len(line) else "")


def load_corpus() -> str:
    """The public-domain English corpus shipped with roundpipe (about 100-300 KB)."""
    return CORPUS_PATH.read_text(encoding="utf-8")


def _read_utf8(p: Path) -> str:
    hint = 'pass a UTF-8 .txt file, or a .jsonl file with one {"text": ...} object per line'
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason}); {hint}") from None
    nul = text.find("\x00")
    if nul >= 0:  # valid UTF-8 yet binary (zero-filled or an image of a disk): never train on it
        raise ValueError(f"{p}: not text (a NUL character at offset {nul}: a binary file); {hint}")
    return text


def _existing_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataFileNotFoundError(
            f"data file {str(p)!r} does not exist; pass an existing .txt/.jsonl path or the text itself"
        )
    if not p.is_file():
        raise ValueError(f"data path {str(p)!r} is not a file")
    return p


def _looks_like_path(value: str) -> bool:
    return (
        "\n" not in value
        and len(value) < 4096
        and (os.path.exists(value) or value.endswith((".txt", ".jsonl", ".json", ".md")))
    )


def load_text(text_or_path: str | os.PathLike[str]) -> str:
    """Text given directly, or read from a .txt file, or the joined texts of a .jsonl file.

    A ``str`` is a path when it names an existing file or ends in .txt/.jsonl/.json/.md (then the
    file must exist); any other string is the text itself.
    """
    if isinstance(text_or_path, str) and not _looks_like_path(text_or_path):
        text = text_or_path
    else:
        p = _existing_file(text_or_path)
        if p.suffix == ".jsonl":
            text = DOC_SEPARATOR.join(read_jsonl(p))
        else:
            text = _read_utf8(p)
    if not text:
        raise ValueError(f"{text_or_path!r} is empty; training needs text")
    return text


def _step_generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.blake2b(f"roundpipe-data:{seed}:{step}".encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def batch_at(
    tokens: torch.Tensor, step: int, seq_len: int, batch_size: int, seed: int
) -> dict[str, torch.Tensor]:
    """The batch of ``step``: ``batch_size`` windows of ``seq_len`` tokens at seeded random offsets.

    ``labels`` equals ``input_ids`` (the transformers convention: the model shifts them).
    """
    starts = torch.randint(
        0, tokens.numel() - seq_len + 1, (batch_size,), generator=_step_generator(seed, step)
    )
    index = starts[:, None] + torch.arange(seq_len)[None, :]
    input_ids = tokens[index]
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def token_batches(
    text_or_path: str | os.PathLike[str],
    seq_len: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches ``{"input_ids": [B, T], "labels": [B, T]}`` (int64), one per step from ``start_step``.

    The batch of step ``s`` is the same for every run with the same text, sizes and seed, so
    resuming at ``start_step=s`` continues the exact data stream. See :func:`load_text` for how
    ``text_or_path`` is read.
    """
    for name, value, low in (
        ("seq_len", seq_len, 1),
        ("batch_size", batch_size, 1),
        ("start_step", start_step, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    text = load_text(text_or_path)
    tokens = torch.tensor(encode(text), dtype=torch.long)
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"the text has {tokens.numel()} tokens but seq_len={seq_len} needs at least {seq_len + 1}; "
            "use a longer text or a smaller seq_len"
        )
    return _batches(tokens, seq_len, batch_size, seed, start_step)


def _batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int, start_step: int
) -> Iterator[dict[str, torch.Tensor]]:
    step = start_step
    while True:
        yield batch_at(tokens, step, seq_len, batch_size, seed)
        step += 1


__all__ = [
    "BYTE_VOCAB",
    "CORPUS_PATH",
    "ByteTokenizer",
    "DataFileNotFoundError",
    "batch_at",
    "decode",
    "encode",
    "load_corpus",
    "load_text",
    "read_jsonl",
    "token_batches",
]
