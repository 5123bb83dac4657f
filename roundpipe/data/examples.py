"""Datasets as people have them, turned into training examples: token ids and their labels.

People fine-tune on files of records: plain text (``text``), prompt/completion pairs (``prompt``,
``completion``) or conversations (``messages``, a list of ``{"role", "content"}``). The records are
read with Hugging Face `datasets` from local jsonl, json, parquet or csv files, the format is told
by the columns present, and each record becomes one `Example`. Labels are -100 where no loss is
taken: by default the prompt of a pair and every turn of a conversation but the assistant's, so
the model learns to answer, not to ask (``train_on_inputs`` takes the loss on everything).

Conversations are rendered by the tokenizer's own chat template. Templates rarely mark the
assistant's text, so the assistant turns are found by rendering the conversation up to each of
them: the characters that rendering the turn adds are the turn's, and every token that starts in
them carries a label. The first label of every example is -100: in a packed sequence its first
token would otherwise be predicted from the example before it.

A record that cannot become an example raises `DataError` naming the file, the line (jsonl, csv)
or row, and the field, with what to change. Nothing here downloads or keeps state.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roundpipe.data.text import jsonl_lines, jsonl_objects
from roundpipe.errors import DataError

IGNORE_INDEX = -100
FIELDS = ("text", "prompt", "completion", "messages")
ROLES = ("system", "user", "assistant", "tool")
LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Example:
    """One training example: ``ids`` and ``labels`` of equal length (-100 = no loss)."""

    ids: list[int]
    labels: list[int]
    # Where the record came from ("chats.jsonl:12"), for messages about it; not part of its value.
    source: str = field(default="", compare=False, repr=False)

    @property
    def trainable(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass
class Records:
    """The records of one file, its columns, and where each record is in it (for messages)."""

    path: Path
    rows: Sequence[Mapping[str, Any]]  # a datasets.Dataset, or the parsed lines of a jsonl
    columns: list[str]
    where: Callable[[int], str]


@dataclass(frozen=True)
class HubDataset:
    """A dataset named on the Hugging Face hub (``owner/name``), read by `datasets` through its
    own cache; only where the network (or that cache) allows."""

    name: str
    split: str = "train"

    def __str__(self) -> str:
        return self.name


def looks_like_hub_name(value: str) -> bool:
    """``owner/name`` or ``name``: no file suffix a local file of ours would have, no path parts."""
    parts = value.split("/")
    return (
        0 < len(parts) <= 2
        and all(part and part not in (".", "..") for part in parts)
        and Path(value).suffix.lower() not in (*LOADERS, ".txt")
        and not value.startswith(("~", "."))
    )


def load_hub_records(source: HubDataset) -> Records:
    """A hub dataset's split as records; when the hub cannot be reached or has no such dataset,
    a `DataError` that says so and what to pass instead."""
    import datasets

    datasets.disable_progress_bars()
    try:
        rows = datasets.load_dataset(source.name, split=source.split)
    except Exception as exc:  # offline, unknown name, gated, no such split: one line, no traceback
        raise DataError(
            f"--data {source.name!r}: no such local file, and the Hugging Face hub gave no dataset of that "
            f"name ({type(exc).__name__}: {str(exc)[:200]}); pass a local .jsonl, .json, .parquet, .csv or "
            ".txt file, or a hub name this machine can reach"
        ) from None
    where = lambda i: f"{source.name} ({source.split}): row {i + 1}"  # noqa: E731
    return Records(Path(source.name), rows, list(rows.column_names), where)


def is_records_file(path: Path) -> bool:
    return path.suffix.lower() in LOADERS


def load_records(path: Path) -> Records:
    """The records of a jsonl/json/parquet/csv file, read by `datasets` (cached in a temporary
    directory that goes away: a run leaves nothing behind). A jsonl that `datasets` cannot read
    (a line that is not JSON, values whose types differ from line to line) is read line by line
    instead, so the message names the line."""
    import datasets

    datasets.disable_progress_bars()
    kind = LOADERS[path.suffix.lower()]
    where = _locator(path, kind)
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # its reader logs the failures reported in one line below
    try:
        with tempfile.TemporaryDirectory(prefix="roundpipe-data-") as cache:
            rows = datasets.load_dataset(
                kind, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
    except Exception as exc:  # the readers raise many types; report the file, never a traceback
        if path.suffix.lower() == ".jsonl":
            lines = _jsonl_lines(path)
            return Records(path, lines, sorted({key for line in lines for key in line}), where)
        cause = exc.__cause__ or exc
        raise DataError(f"{path}: not readable as {kind} ({type(cause).__name__}: {cause})") from None
    finally:
        logger.setLevel(level)
    return Records(path, rows, list(rows.column_names), where)


def _jsonl_lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return [record for _, record in jsonl_objects(path, text)]


def _locator(path: Path, kind: str) -> Callable[[int], str]:
    """Row index -> "file:line" (jsonl: blank lines skipped; csv: after the header) or "file: row N"."""
    if path.suffix.lower() == ".jsonl":
        lines = [n for n, _ in jsonl_lines(path.read_text(encoding="utf-8", errors="replace"))]
        return lambda i: f"{path}:{lines[i]}" if i < len(lines) else f"{path}: row {i + 1}"
    if kind == "csv":
        return lambda i: f"{path}:{i + 2}"
    return lambda i: f"{path}: row {i + 1}"


def detect_format(columns: list[str], fields: Mapping[str, str], path: Path) -> str:
    """``"chat"``, ``"prompt"`` or ``"text"``, from the columns the file has."""
    name = {key: fields.get(key, key) for key in FIELDS}
    if name["messages"] in columns:
        return "chat"
    if name["prompt"] in columns and name["completion"] in columns:
        return "prompt"
    if name["text"] in columns:
        return "text"
    raise DataError(
        f"{path}: no column to train on (it has {columns}); records need {name['text']!r}, or "
        f"{name['prompt']!r} and {name['completion']!r}, or {name['messages']!r}. Map other names "
        "with --field, e.g. --field prompt=question --field completion=answer"
    )


class ExampleBuilder:
    """Turns the records of one format into examples with one tokenizer."""

    def __init__(self, tokenizer: Any, fields: Mapping[str, str], train_on_inputs: bool) -> None:
        self.tokenizer = tokenizer
        self.name = {key: fields.get(key, key) for key in FIELDS}
        self.train_on_inputs = train_on_inputs
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos: list[int] = [eos] if isinstance(eos, int) else []

    def check_chat(self, records: Records) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                f"{records.where(0)}: field {self.name['messages']!r}: the tokenizer "
                f"({getattr(self.tokenizer, 'name_or_path', '?')}) has no chat template to render "
                "conversations with; use a model directory whose tokenizer has one, or give "
                "prompt/completion records instead"
            )

    def text(self, record: Mapping[str, Any], where: str) -> Example:
        ids = self.tokenizer.encode(self._string(record, "text", where), add_special_tokens=True)
        ids = ids + self.eos
        return _example(ids, list(ids))

    def prompt(self, record: Mapping[str, Any], where: str) -> Example:
        prompt = self.tokenizer.encode(self._string(record, "prompt", where), add_special_tokens=True)
        completion = self.tokenizer.encode(
            self._string(record, "completion", where), add_special_tokens=False
        )
        completion = completion + self.eos
        masked = list(prompt) if self.train_on_inputs else [IGNORE_INDEX] * len(prompt)
        return _example(prompt + completion, masked + completion)

    def chat(self, record: Mapping[str, Any], where: str) -> Example:
        messages = self._messages(record, where)
        render = self._render
        text = render(messages, False, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = render(messages[:i], True, where), render(messages[: i + 1], False, where)
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise DataError(
                    f"{where}: field {self.name['messages']!r}: the chat template does not render the "
                    f"conversation turn by turn (message {i} changes what comes before it), so the "
                    "assistant's tokens cannot be told apart; pass --train-on-inputs to train on all of it"
                )
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        if self.train_on_inputs:
            return _example(ids, list(ids))
        starts = [start for start, _ in encoded["offset_mapping"]]
        labels = [
            tok if any(a <= s < b for a, b in spans) else IGNORE_INDEX
            for tok, s in zip(ids, starts, strict=True)
        ]
        return _example(ids, labels)

    def _render(self, messages: list[dict[str, str]], generation: bool, where: str) -> str:
        if not messages and not generation:
            return ""
        try:
            return str(
                self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            )
        except Exception as exc:  # a template may raise anything (jinja's raise_exception)
            raise DataError(
                f"{where}: field {self.name['messages']!r}: the chat template refused it ({exc})"
            ) from None

    def _string(self, record: Mapping[str, Any], key: str, where: str) -> str:
        field = self.name[key]
        value = record.get(field)
        if not isinstance(value, str):
            got = "missing" if value is None else f"a {type(value).__name__}"
            raise DataError(f"{where}: field {field!r} must be a string, got {got}")
        return value

    def _messages(self, record: Mapping[str, Any], where: str) -> list[dict[str, str]]:
        field = self.name["messages"]
        value = record.get(field)
        if not isinstance(value, list) or not value:
            got = "missing" if value is None else repr(value)[:40]
            raise DataError(f"{where}: field {field!r} must be a non-empty list of messages, got {got}")
        out = []
        for i, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise DataError(f"{where}: field {field!r}[{i}] must be an object with 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise DataError(
                    f"{where}: field {field!r}[{i}].role is {role!r}; expected one of {', '.join(ROLES)}"
                )
            if not isinstance(content, str):
                raise DataError(
                    f"{where}: field {field!r}[{i}].content must be a string, got {content!r:.40}"
                )
            out.append({"role": role, "content": content})
        return out


def _example(ids: list[int], labels: list[int]) -> Example:
    labels = list(labels)
    if labels:
        labels[0] = IGNORE_INDEX  # see the module docstring
    return Example(list(ids), labels)


def load_examples(
    path: str | os.PathLike[str] | HubDataset,
    tokenizer: Any,
    *,
    fields: Mapping[str, str] | None = None,
    train_on_inputs: bool = False,
    max_len: int | None = None,
    truncation: bool = False,
) -> list[Example]:
    """Every record of ``path`` as an `Example`; an example longer than ``max_len`` is an error
    unless ``truncation``; a file without any token to train on is an error."""
    records = load_hub_records(path) if isinstance(path, HubDataset) else load_records(Path(path))
    if len(records.rows) == 0:
        raise DataError(f"{records.path} holds no records; it needs at least one")
    fmt = detect_format(records.columns, fields or {}, records.path)
    builder = ExampleBuilder(tokenizer, fields or {}, train_on_inputs)
    if fmt == "chat":
        builder.check_chat(records)
    make = getattr(builder, fmt)
    examples = []
    for i, record in enumerate(records.rows):
        example = make(record, records.where(i))
        example.source = records.where(i)
        examples.append(example)
    if max_len is not None:
        examples = fit_length(examples, max_len, truncation)
    if not any(example.trainable for example in examples):
        raise DataError(
            f"{records.path}: no token to train on in {len(examples)} {fmt} records (every label is "
            "masked: no completion or assistant turn survives); check the fields, or pass --train-on-inputs"
        )
    return examples


def fit_length(
    examples: Sequence[Example], max_len: int, truncation: bool, *, limit: str | None = None
) -> list[Example]:
    """``examples`` with none longer than ``max_len``: cut when ``truncation``, else an error
    naming the first that is too long. ``limit`` says where ``max_len`` comes from (default:
    ``--seq-len``)."""
    limit = limit or f"--seq-len {max_len}"
    fitted = []
    for example in examples:
        if len(example.ids) > max_len:
            if not truncation:
                raise DataError(
                    f"{example.source or 'an example'}: the example has {len(example.ids)} tokens, more "
                    f"than {limit}; pass --truncation to cut it, or a larger --seq-len"
                )
            example = Example(example.ids[:max_len], example.labels[:max_len], example.source)
        fitted.append(example)
    return fitted


__all__ = [
    "FIELDS",
    "IGNORE_INDEX",
    "Example",
    "HubDataset",
    "detect_format",
    "fit_length",
    "is_records_file",
    "load_examples",
    "load_hub_records",
    "load_records",
    "looks_like_hub_name",
]
