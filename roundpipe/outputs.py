"""Checks of the places a run will write to, made before any work starts.

Why a module of its own: a training run that trains for an hour and then finds that its
``--export`` directory holds someone else's files has wasted the hour. Every output location is
therefore judged up front, by the same rules the writers apply when they finally write
(`roundpipe.checkpoint.export_pretrained` calls `check_export_target` too), so the early check
and the late one can never disagree. Judging only: this module must never create, change or
remove anything, and never import torch (``roundpipe export`` and ``train`` call it before torch
is loaded).
"""

from __future__ import annotations

import os
from pathlib import Path

from roundpipe.errors import CheckpointError, ConfigError

# Files that mark a directory as a model written by save_pretrained (transformers or peft).
EXPORT_MARKERS = ("config.json", "adapter_config.json")


def check_export_target(path: str | os.PathLike[str], what: str = "export directory") -> Path:
    """``path`` may receive an export: it is new, an empty directory, or an earlier export
    (which the export replaces atomically). Raises `CheckpointError` naming the problem."""
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise CheckpointError(
                f"{what} {target} exists and is not a directory; choose a new or empty directory"
            )
        if any(target.iterdir()) and not any((target / name).is_file() for name in EXPORT_MARKERS):
            raise CheckpointError(
                f"{what} {target} already holds other files (no {' or '.join(EXPORT_MARKERS)}); refusing to "
                "replace it: choose a new or empty directory"
            )
    check_can_create(target, what)
    return target


def check_can_create(path: Path, what: str) -> None:
    """``path`` exists as a writable directory, or could be made: its nearest existing ancestor
    is a writable directory. Raises `ConfigError` naming ``what`` and the blocking path."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{what} {path}: {probe} is a file, not a directory; choose another location")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path}: {probe} is not writable; choose another location")


__all__ = ["EXPORT_MARKERS", "check_can_create", "check_export_target"]
