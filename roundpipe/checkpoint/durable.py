"""Writing checkpoint files so that they survive a crash: safetensors weights, and flushing a
directory tree to disk before it is renamed into place.

Why a module of its own: `roundpipe.checkpoint.store` decides what a checkpoint holds and the
order of the renames that install it; what makes each write durable is one concern below that.
It must never rename or remove anything (the store's install sequence does), and never write
outside the path it is given.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    # safetensors refuses views and shared storage: give it contiguous private tensors.
    path.write_bytes(save({name: t.detach().contiguous().clone() for name, t in tensors.items()}))


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (and ``root`` itself) to disk."""
    for child in sorted(root.rglob("*")):
        if child.is_dir():
            fsync_dir(child)
        elif child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    # Directory fsync makes the renames durable; some platforms cannot open directories.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
