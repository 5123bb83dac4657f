"""Safetensors files read in place: the header parsed by hand, each tensor a view of the mapped file.

Why not ``safetensors.safe_open``: what it hands back is a tensor whose memory belongs to the
library, and whether that is the page cache or a private copy depends on its version. Here a
shard file is mapped copy-on-write (``MAP_PRIVATE``) and every tensor is ``torch.frombuffer`` over
its byte range, so a frozen weight costs no host memory beyond the page cache pages it touches,
and the mapping lives exactly as long as some tensor still views it. The format is small: 8 bytes
of little-endian header length, a JSON header naming each tensor's dtype, shape and byte range
(relative to the end of the header), then the bytes.

This module must never copy a tensor it can view, nor write to a file it maps (a write to a view
lands in a private page, never in the file).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from roundpipe.errors import ModelError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard: its dtype, shape and byte range from the start of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors ``path`` holds, by name; a `ModelError` naming the file when it is no
    safetensors file or is cut short."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ModelError(
                    f"{path} is not a safetensors file (header length {length} > file size {size})"
                )
            header = json.loads(f.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"cannot read the safetensors header of {path}: {exc}") from exc
    base = 8 + length
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelError(
                f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which roundpipe cannot load"
            )
        try:
            start, end = (int(x) for x in info["data_offsets"])
            entry = Entry(dtype, tuple(int(d) for d in info["shape"]), base + start, base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(
                f"{path}: tensor {name!r} has no valid shape/data_offsets in the header"
            ) from exc
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if entry.end > size or entry.end - entry.start != numel * dtype.itemsize:
            raise ModelError(
                f"{path}: tensor {name!r} ({info['dtype']} {list(entry.shape)}) does not fit its byte range "
                f"{start}..{end} (file of {size} bytes): the file is truncated or damaged"
            )
        entries[name] = entry
    return entries


class MappedShard:
    """One safetensors file, mapped copy-on-write; `tensor` views it without copying.

    The mapping is released when this object and every tensor from it are gone (each view holds
    a reference to it through ``torch.frombuffer``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries = read_header(path)
        with open(path, "rb") as f:
            size = path.stat().st_size
            # An empty mapping is refused by mmap; a shard of zero-size tensors only needs no bytes.
            self._map: mmap.mmap | None = (
                mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            )

    def prefetch(self) -> None:
        """Ask the kernel to read the whole file ahead (from disk into the page cache) while the
        loader works through the tensors in order."""
        if self._map is not None and hasattr(mmap, "MADV_WILLNEED"):
            self._map.madvise(mmap.MADV_WILLNEED)

    def release(self, name: str) -> None:
        """Drop this process's pages of ``name`` (those wholly inside its byte range) once what
        the run keeps of it is a copy: a view of the same pages must no longer be used. Pages of
        a private mapping that were never written are simply unmapped; the page cache keeps them,
        the process's resident size no longer counts them."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        entry = self.entries[name]
        page = mmap.PAGESIZE
        start = -(-entry.start // page) * page
        end = entry.end // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a view of the mapped bytes (a copy only when its offset is not
        a multiple of its element size, which no safetensors writer produces)."""
        entry = self.entries[name]
        count = (entry.end - entry.start) // entry.dtype.itemsize
        if count == 0 or self._map is None:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if entry.start % entry.dtype.itemsize:
            raw = bytearray(self._map[entry.start : entry.end])
            return torch.frombuffer(raw, dtype=entry.dtype, count=count).view(entry.shape)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=count, offset=entry.start)
        return flat.view(entry.shape)

    def nbytes(self, name: str) -> int:
        entry = self.entries[name]
        return entry.end - entry.start


def checkpoint_files(directory: Path) -> dict[Path, list[str]]:
    """Per shard file of the checkpoint in ``directory`` (sharded with an index, or one
    ``model.safetensors``), the tensor names the index assigns to it, in file order.

    A `ModelError` when the index is no JSON, has no ``weight_map``, or names a missing file."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(
                f"{index} is not valid JSON ({exc}); rewrite the model with save_pretrained"
            ) from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index} has no 'weight_map' naming each tensor's shard file")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(directory / str(file), []).append(name)
        missing = sorted(str(p.name) for p in files if not p.is_file())
        if missing:
            raise ModelError(
                f"{index} names shard file(s) missing from {directory}: {', '.join(missing)}; "
                "the download or copy is incomplete"
            )
        return dict(sorted(files.items(), key=lambda item: item[0].name))
    single = directory / SINGLE_FILE
    if single.is_file():
        return {single: list(read_header(single))}
    raise ModelError(f"{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def is_safetensors_checkpoint(directory: Path) -> bool:
    return (directory / INDEX_FILE).is_file() or (directory / SINGLE_FILE).is_file()


__all__ = [
    "DTYPES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "Entry",
    "MappedShard",
    "checkpoint_files",
    "is_safetensors_checkpoint",
    "read_header",
]
