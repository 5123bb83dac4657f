"""Small, download-free text data: a byte-level tokenizer, a shipped public-domain corpus, batches.

It exists so examples, tests and benchmarks can train a language model anywhere (no network). It
must never download anything, and its batches must depend only on (text, sizes, seed, step).
"""

from roundpipe.data.text import (
    BYTE_VOCAB,
    CORPUS_PATH,
    ByteTokenizer,
    DataFileNotFoundError,
    batch_at,
    decode,
    encode,
    load_corpus,
    load_text,
    read_jsonl,
    token_batches,
)

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
