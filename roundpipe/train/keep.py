"""Keeping the last K checkpoints of a run, and noticing (and explaining) when it stops being finite.

Why apart from the loop: `roundpipe train` always saves into ``<run>/checkpoint`` (what
``--resume`` and the messages name), and a save replaces it atomically. Keeping older ones means
that, just before a save, the current ``checkpoint`` is preserved as ``checkpoint-<step>`` (hard
links, so no data is copied: the save writes new files and never changes the old ones in place)
and all but the newest K-1 of those are removed. This must never leave ``checkpoint`` incomplete
or remove it: at every moment the newest complete checkpoint is there under its usual name. Nor
may a save write weights that hold a NaN/inf: `non_finite_weight` is checked first.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roundpipe.checkpoint import CheckpointError, read_checkpoint_meta

if TYPE_CHECKING:
    from roundpipe.pipe import RoundPipe

_KEPT = re.compile(r"-(\d+)$")


def kept_checkpoints(latest: Path) -> list[Path]:
    """The ``<latest>-<step>`` directories beside ``latest``, oldest step first."""
    if not latest.parent.is_dir():
        return []
    found = []
    for child in latest.parent.iterdir():
        match = _KEPT.search(child.name)
        if child.is_dir() and match and child.name == f"{latest.name}-{match.group(1)}":
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def preserve_before_save(latest: Path, keep: int, next_step: int) -> None:
    """Before ``latest`` is replaced by the checkpoint of ``next_step``: keep a copy of it as
    ``<latest>-<its step>`` when ``keep`` > 1, then prune to the newest ``keep`` - 1 copies."""
    if keep > 1 and (latest / "meta.json").is_file():
        try:
            step = int(read_checkpoint_meta(latest)["data_step"])
        except (CheckpointError, KeyError, TypeError, ValueError):
            step = None  # damaged or foreign: nothing worth keeping
        target = latest.parent / f"{latest.name}-{step}"
        if step is not None and step != next_step and not target.exists():
            _link_copy(latest, target)
    for old in kept_checkpoints(latest)[: max(0, len(kept_checkpoints(latest)) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _link_copy(source: Path, target: Path) -> None:
    """``target`` as a complete copy of ``source`` or not at all (built beside it, then renamed)."""
    tmp = target.parent / f".tmp-{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # a filesystem without hard links: copy
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, tmp, copy_function=link)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def non_finite_message(what: str, step: int, precision: str, last_good: Path | None) -> str:
    """Why the run stopped at ``step`` (``what`` is not finite) and what to try, for this run's
    precision."""
    kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
    causes = [
        "the learning rate is too high (lower --lr, raise --warmup-steps, or set --max-grad-norm)",
        f"bad data near step {step} (check --data)",
    ]
    if precision != "fp32":
        causes.append(f"{precision} overflowed (try --precision fp32)")
    return f"{what} at step {step}; stopped without saving ({kept}). Likely causes: " + "; ".join(causes)


def non_finite_weight(pipe: RoundPipe) -> str | None:
    """The first trainable weight holding a NaN/inf (the optimizer's copy), or None. A step's
    bad gradient shows here one step before the loss shows it."""
    pipe.synchronize()
    for name, _, master in pipe.host.named_masters():
        if not bool(torch.isfinite(master).all()):
            return name
    return None


__all__ = ["kept_checkpoints", "non_finite_message", "non_finite_weight", "preserve_before_save"]
