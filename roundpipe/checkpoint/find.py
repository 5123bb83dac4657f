"""Which checkpoint a path means: a checkpoint directory, or a run directory holding several.

Why: ``roundpipe train`` prints its run directory (``runs/NAME``), and people pass that where a
checkpoint is asked for (``--resume``, ``roundpipe checkpoint verify``, ``roundpipe export``).
A run directory holds ``checkpoint`` (the newest) and ``checkpoint-<step>`` copies; this module
names the newest intact one, and, for a damaged checkpoint, the intact older one beside it to use
instead. It reads only meta.json and manifest files (through
`roundpipe.checkpoint.manifest.verify_checkpoint`), never imports torch, and never writes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from roundpipe.checkpoint.manifest import ManifestMissingError, verify_checkpoint
from roundpipe.errors import CheckpointError

LATEST = "checkpoint"  # as roundpipe.train.rundir.CHECKPOINT_DIR
META = "meta.json"
_KEPT = re.compile(rf"^{LATEST}-(\d+)$")


def run_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(data step, path) of the checkpoints of the run directory ``run`` whose meta.json says
    their step, newest first (the latest before a kept copy of the same step)."""
    found: list[tuple[int, int, Path]] = []
    if not run.is_dir():
        return []
    for child in run.iterdir():
        if child.name != LATEST and not _KEPT.match(child.name):
            continue
        try:
            step = int(json.loads((child / META).read_text(encoding="utf-8"))["data_step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append((step, child.name == LATEST, child))
    return [(step, path) for step, _, path in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]


def is_intact(checkpoint: Path) -> bool:
    """Every file the manifest lists is as written (a checkpoint without a manifest counts as
    intact when its meta.json is there: it cannot be checked further)."""
    try:
        verify_checkpoint(checkpoint)
    except ManifestMissingError:
        return (checkpoint / META).is_file()
    except CheckpointError:
        return False
    return True


def resolve_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The checkpoint ``path`` means, and a note when it is not ``path`` itself: a run directory
    gives its newest intact checkpoint. Anything else is returned as it is, for the caller's own
    checks to report. Raises `CheckpointError` for a run directory without an intact checkpoint."""
    given = Path(path).expanduser()
    if (given / META).is_file() or not given.is_dir():
        return given, None
    found = run_checkpoints(given)
    if not found:
        if given.name == LATEST or _KEPT.match(given.name):
            return given, None
        raise CheckpointError(
            f"{given} is neither a checkpoint (no {META}) nor a run directory holding one (no "
            f"{LATEST}/ nor {LATEST}-<step>/ in it); pass runs/NAME or runs/NAME/{LATEST}"
        )
    damaged: list[Path] = []
    for step, checkpoint in found:
        if is_intact(checkpoint):
            note = f"{given} is a run directory: using its checkpoint {checkpoint} (step {step})"
            if damaged:
                note += f"; {', '.join(map(str, damaged))} is damaged"
            return checkpoint, note
        damaged.append(checkpoint)
    raise CheckpointError(
        f"run directory {given}: every checkpoint in it is damaged ({', '.join(map(str, damaged))}); "
        "'roundpipe checkpoint verify DIR' names the file"
    )


def intact_alternative(checkpoint: str | os.PathLike[str]) -> Path | None:
    """The newest intact checkpoint of the same run other than ``checkpoint`` (None if none)."""
    path = Path(checkpoint).expanduser()
    for _, other in run_checkpoints(path.parent):
        if other.resolve() != path.resolve() and is_intact(other):
            return other
    return None


def with_alternative(exc: CheckpointError, checkpoint: str | os.PathLike[str]) -> CheckpointError:
    """``exc`` (a damaged ``checkpoint``) with the intact older checkpoint to use instead, if any."""
    other = intact_alternative(checkpoint)
    if other is None:
        return exc
    step = json.loads((other / META).read_text(encoding="utf-8")).get("data_step")
    return CheckpointError(
        f"{exc}; the older checkpoint {other} (step {step}) is intact: resume from it with --resume {other}"
    )


__all__ = ["intact_alternative", "is_intact", "resolve_checkpoint", "run_checkpoints", "with_alternative"]
