"""Where a training run writes: its directory, its metrics log, and what a resume may replace.

Why apart from the loop: every decision about output locations is taken here, before the model is
built, so a run never trains for an hour and then finds it cannot write (``--export`` into a
directory of other files, a run directory under a file). And resuming must never destroy a newer
run: resuming an older copy of a checkpoint while the run directory holds a newer one continues in
a new run directory, unless ``--overwrite`` says to replace the newer one. Lines of
``metrics.jsonl`` that a resume redoes are moved to ``metrics.replaced.jsonl``, never deleted.

This module decides and prepares; it must never train, and it must never remove a checkpoint
except the newer ones ``--overwrite`` explicitly gives up.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.outputs import check_can_create, check_export_target
from roundpipe.train.config import TrainConfig
from roundpipe.train.keep import kept_checkpoints

METRICS_FILE = "metrics.jsonl"
REPLACED_METRICS_FILE = "metrics.replaced.jsonl"  # lines a resume redid, kept rather than cut
CHECKPOINT_DIR = "checkpoint"


@dataclass
class RunPlace:
    """Where this run writes, and what to tell the user about that choice."""

    out_dir: Path
    notes: list[str] = field(default_factory=list)
    source_metrics: Path | None = None  # an older run's log whose first steps this run continues
    remove: list[Path] = field(default_factory=list)  # newer checkpoints --overwrite gives up


def run_dir(config: TrainConfig) -> Path:
    """``<out>/<name>``; the name defaults to the current time (made unique with a suffix)."""
    out = Path(config.out).expanduser()
    if config.name is not None:
        return out / config.name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = out / stamp, 2
    while candidate.exists():
        candidate, n = out / f"{stamp}-{n}", n + 1
    return candidate


def plan_outputs(config: TrainConfig, resume_step: int | None) -> RunPlace:
    """Decide the run directory and check every output location; raises `ConfigError` or
    `CheckpointError` (exit 2) before any work starts."""
    out_dir = run_dir(config)
    place = RunPlace(out_dir)
    if resume_step is None:
        if (out_dir / METRICS_FILE).exists():
            # --overwrite gives up only the newer checkpoints of a resume: a finished run is never
            # deleted by a flag, so say so rather than leave it looking ignored.
            overwrite = (
                f" (--overwrite replaces only the newer checkpoints of a --resume; to start over in "
                f"{out_dir}, delete it first)"
                if config.overwrite
                else ""
            )
            raise ConfigError(
                f"run directory {out_dir} already holds a run; choose another --name, or continue it with "
                f"--resume {out_dir / CHECKPOINT_DIR}{overwrite}"
            )
    else:
        place = _resume_place(config, out_dir, resume_step)
    check_can_create(place.out_dir, "run directory")
    if config.export:
        export = check_export_target(Path(config.export).expanduser(), "--export")
        if _inside(export, place.out_dir / CHECKPOINT_DIR):
            raise ConfigError(
                f"--export {export} is inside the run's checkpoint; choose a directory outside it"
            )
    return place


def _resume_place(config: TrainConfig, out_dir: Path, resume_step: int) -> RunPlace:
    source = Path(config.resume or "").resolve()
    newer = [
        (step, path)
        for step, path in _checkpoints_in(out_dir)
        if step > resume_step and path.resolve() != source
    ]
    if not newer:
        return RunPlace(out_dir)
    step, path = max(newer)
    if config.overwrite:
        note = (
            f"--overwrite: {path} (step {step}) and any other checkpoint of {out_dir} newer than step "
            f"{resume_step} are replaced by this run"
        )
        return RunPlace(out_dir, [note], remove=[p for _, p in newer])
    fresh = _unique(out_dir.parent / f"{out_dir.name}-from-{resume_step}")
    note = (
        f"{path} is at step {step}, newer than this checkpoint (step {resume_step}): continuing in "
        f"{fresh} so that run stays as it is (pass --overwrite to continue in {out_dir} instead)"
    )
    return RunPlace(fresh, [note], source_metrics=out_dir / METRICS_FILE)


def _checkpoints_in(run: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint of ``run`` whose meta.json says its step."""
    found = []
    latest = run / CHECKPOINT_DIR
    for path in [latest, *kept_checkpoints(latest)]:
        try:
            meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
            found.append((int(meta["data_step"]), path))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # absent or damaged: nothing this run would lose
    return found


def _unique(path: Path) -> Path:
    candidate, n = path, 2
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def _inside(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True


def prepare_run_dir(place: RunPlace, resume_step: int | None) -> Path:
    """Create the run directory and its metrics log (for a resume: the steps up to
    ``resume_step``, redone lines moved to `REPLACED_METRICS_FILE`); return the log's path."""
    path = place.out_dir
    path.mkdir(parents=True, exist_ok=True)
    metrics = path / METRICS_FILE
    if resume_step is None:
        metrics.write_text("")
        return metrics
    for old in place.remove:
        shutil.rmtree(old, ignore_errors=True)
    source = place.source_metrics or metrics
    kept, redone = _split_lines(source, resume_step)
    if redone and source == metrics:
        with open(path / REPLACED_METRICS_FILE, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in redone))
    # Written beside and renamed: a kill here leaves the old log or the new one, never half.
    tmp = path / f".{METRICS_FILE}.tmp"
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, metrics)
    return metrics


def _split_lines(metrics: Path, resume_step: int) -> tuple[list[str], list[str]]:
    """The log's lines of steps up to ``resume_step``, and the others (redone by this run)."""
    kept: list[str] = []
    redone: list[str] = []
    if not metrics.exists():
        return kept, redone
    for line in metrics.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            redone.append(line)  # unreadable (a line cut by a kill): kept aside, not in the log
            continue
        (kept if step <= resume_step else redone).append(line)
    return kept, redone


def saved_elapsed(resume_meta: dict[str, Any] | None) -> float:
    """Seconds the resumed run had already trained (0 for a fresh run)."""
    if resume_meta is None:
        return 0.0
    extra = resume_meta.get("extra")
    value = extra.get("elapsed", 0.0) if isinstance(extra, dict) else 0.0
    return float(value) if isinstance(value, int | float) else 0.0


__all__ = [
    "CHECKPOINT_DIR",
    "METRICS_FILE",
    "REPLACED_METRICS_FILE",
    "RunPlace",
    "plan_outputs",
    "prepare_run_dir",
    "run_dir",
    "saved_elapsed",
]
