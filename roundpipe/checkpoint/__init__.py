"""Checkpoints of a run on disk: writing and loading them (`store`), the manifest that proves a
checkpoint intact (`manifest`), and finding the newest intact one of a run (`find`).

The public names (`save_checkpoint`, `load_checkpoint`, `read_checkpoint_meta`,
`export_pretrained`, `CheckpointInfo`, `CheckpointError`) are forwarded from `store` on first
access: `store` needs torch, while ``roundpipe checkpoint verify`` and the training parser reach
`manifest` and `find` through this package and must load without it (tests/test_layering.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roundpipe.checkpoint.store import (
        CheckpointError,
        CheckpointInfo,
        export_pretrained,
        load_checkpoint,
        read_checkpoint_meta,
        save_checkpoint,
    )

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "export_pretrained",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    # Deferred: the store imports torch, the manifest and the finder do not.
    if name in __all__:
        from roundpipe.checkpoint import store

        return getattr(store, name)
    raise AttributeError(f"module 'roundpipe.checkpoint' has no attribute {name!r}")
