"""Byte tokenizer, shipped corpus, deterministic resumable batches, readers and their errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from roundpipe.data import (
    CORPUS_PATH,
    ByteTokenizer,
    batch_at,
    decode,
    encode,
    load_corpus,
    load_text,
    read_jsonl,
    token_batches,
)


def test_tokenizer_round_trip() -> None:
    text = "The quick brown fox — naïve café, 日本語 ✓\n"
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text
    assert decode(torch.tensor(ids)) == text


def test_specials() -> None:
    tok = ByteTokenizer(specials=("<bos>", "<eos>"))
    assert tok.vocab_size == 258
    ids = tok.encode("hi", bos="<bos>", eos="<eos>")
    assert ids == [256, ord("h"), ord("i"), 257]
    assert tok.decode(ids) == "<bos>hi<eos>"
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode("x", eos="<pad>")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([300])
    with pytest.raises(ValueError, match="unique"):
        ByteTokenizer(specials=("<a>", "<a>"))


def test_invalid_utf8_is_replaced() -> None:
    assert decode([0xE6, ord("a")]) == "\ufffda"


def test_shipped_corpus() -> None:
    size = CORPUS_PATH.stat().st_size
    assert 100_000 <= size <= 300_000
    text = load_corpus()
    assert text.isascii()
    assert "We hold these truths to be self-evident" in text
    assert len(set(text.split())) > 3000  # natural, varied English


def test_batches_shapes_and_labels() -> None:
    batch = next(token_batches(load_corpus(), seq_len=32, batch_size=4, seed=0))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()


def test_batches_deterministic_and_resumable() -> None:
    text = load_corpus()
    first = list(itertools.islice(token_batches(text, 16, 3, seed=7), 6))
    again = list(itertools.islice(token_batches(text, 16, 3, seed=7), 6))
    resumed = list(itertools.islice(token_batches(text, 16, 3, seed=7, start_step=4), 2))
    other = next(token_batches(text, 16, 3, seed=8))
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    for a, b in zip(first[4:], resumed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(first[0]["input_ids"], first[1]["input_ids"])
    assert not torch.equal(first[0]["input_ids"], other["input_ids"])
    tokens = torch.tensor(encode(text))
    assert torch.equal(batch_at(tokens, 5, 16, 3, seed=7)["input_ids"], first[5]["input_ids"])


def test_batches_do_not_touch_global_rng() -> None:
    torch.manual_seed(0)
    state = torch.get_rng_state()
    next(token_batches("abcdefghij" * 10, 8, 2, seed=1))
    assert torch.equal(torch.get_rng_state(), state)


def test_windows_come_from_the_text() -> None:
    text = "0123456789" * 3
    batch = next(token_batches(text, 10, 5, seed=0))
    for row in batch["input_ids"]:
        assert decode(row) in text


def test_files_and_jsonl(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, " * 10, encoding="utf-8")
    assert load_text(txt) == load_text(str(txt)) == "hello world, " * 10
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["first doc", "second doc"]) + "\n\n")
    assert read_jsonl(jl) == ["first doc", "second doc"]
    assert load_text(jl) == "first doc\n\nsecond doc"
    batch = next(token_batches(str(jl), 8, 2, seed=0))
    assert batch["input_ids"].shape == (2, 8)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="does not exist"):
        next(token_batches(str(tmp_path / "missing.jsonl"), 8, 2, seed=0))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        token_batches(empty, 8, 2, seed=0)
    with pytest.raises(ValueError, match=r"seq_len=8 needs at least 9"):
        token_batches("short", 8, 2, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        token_batches("long enough text here", 0, 2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        token_batches("long enough text here", 4, 0, seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(bad)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="string field 'text'"):
        read_jsonl(nokey)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match="no records"):
        read_jsonl(blank)


def test_a_binary_file_is_refused_naming_it(tmp_path: Path) -> None:
    from roundpipe.data.text import read_jsonl

    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"weights\.txt: not UTF-8 text \(byte \d+"):
        load_text(str(binary))
    as_jsonl = tmp_path / "data.jsonl"
    as_jsonl.write_bytes(b'{"text": "ok"}\n\xff\n')
    with pytest.raises(ValueError, match=r"data\.jsonl: not UTF-8 text"):
        read_jsonl(as_jsonl)


def test_jsonl_keeps_unicode_line_separators_inside_strings(tmp_path: Path) -> None:
    from roundpipe.data.text import read_jsonl

    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a\u2028b"}\n{"text": "c"}\n', encoding="utf-8")
    assert read_jsonl(path) == ["a\u2028b", "c"]
