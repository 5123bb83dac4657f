"""Checkpoints of a training run, and export of the trained model in the Hugging Face layout.

Why a module of its own: `RoundPipe.state_dict()` is everything a run needs to continue, but a
long run also needs it *on disk* in a form that survives a crash during the write, that a person
can inspect (weights as safetensors, metadata as JSON) and that refuses clearly to load into the
wrong model. A checkpoint is a directory built under a temporary name beside the target, flushed
to disk, and only then renamed to its final name, so the final name never points at a half-written
checkpoint; its ``manifest.json`` (size and sha256 of every file, written last) lets loading refuse
a checkpoint damaged later (`roundpipe.checkpoint.manifest`). `export_pretrained` is the other way out: the user's model saved with its own
``save_pretrained``, for loading with transformers or peft without roundpipe.

This module must never reach into the engine: it goes through the public `RoundPipe` API
(`synchronize`, `state_dict`, `load_state_dict`, `module`) only, and it never unpickles arbitrary
objects (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.checkpoint.durable import fsync_dir, fsync_tree, write_safetensors
from roundpipe.checkpoint.find import run_checkpoints, with_alternative
from roundpipe.checkpoint.manifest import (
    ManifestMissingError,
    check_meta_fields,
    verify_checkpoint,
    write_manifest,
)
from roundpipe.errors import CheckpointError
from roundpipe.faults import fault_point
from roundpipe.outputs import check_export_target
from roundpipe.state import STATE_FORMAT, rng_state, set_rng_state

if TYPE_CHECKING:
    from roundpipe.pipe import RoundPipe

CHECKPOINT_FORMAT = "roundpipe.checkpoint/1"
META_FILE = "meta.json"
WEIGHTS_FILE = "weights.safetensors"
IN_FLIGHT_FILE = "in_flight_weights.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
RNG_FILE = "rng_state.pt"
# Prefixes of the sibling directories a save works in; never a checkpoint themselves.
TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


@dataclass(frozen=True)
class CheckpointInfo:
    """What `load_checkpoint` restored besides the pipe's own state."""

    path: Path
    step: int
    data_step: int
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------- saving


def save_checkpoint(
    pipe: RoundPipe,
    directory: str | os.PathLike[str],
    *,
    data_step: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the run's full state to ``directory`` atomically and return its path.

    Contents: the trainable weights (fp32 optimizer copy; in async mode also the weights the next
    iteration reads), optimizer, LR scheduler and loss-scaler state, step and iteration counters,
    the `RunConfig`, the torch and Python RNG states, ``data_step`` (the data position to resume
    from) and ``extra`` (any JSON-serialisable dict, e.g. the training options). An existing
    checkpoint at ``directory`` is replaced only once the new one is completely on disk.
    """
    if not isinstance(data_step, int) or isinstance(data_step, bool) or data_step < 0:
        raise CheckpointError(f"data_step must be an int >= 0, got {data_step!r}")
    extra = dict(extra or {})
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"extra must be JSON-serialisable ({exc})") from exc
    target = Path(directory)
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(target)

    # The state first (it synchronizes): nothing on disk changes if the pipe fails here.
    state = pipe.state_dict()
    meta = {
        "format": CHECKPOINT_FORMAT,
        "step": int(state["step"]),
        "iteration": int(state["iteration"]),
        "data_step": data_step,
        "config": state["config"],
        "model": _fingerprint(pipe),
        "files": [WEIGHTS_FILE, TRAINING_STATE_FILE, RNG_FILE],
        "extra": extra_json,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if "in_flight_weights" in state:
        meta["files"].append(IN_FLIGHT_FILE)

    return _write_directory(target, lambda tmp: _write_checkpoint_files(tmp, state, meta))


def _write_checkpoint_files(tmp: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    write_safetensors(tmp / WEIGHTS_FILE, state["model"])
    if "in_flight_weights" in state:
        write_safetensors(tmp / IN_FLIGHT_FILE, state["in_flight_weights"])
    fault_point("save", meta["data_step"])  # tests: a kill with the checkpoint half written
    _write_torch(tmp / TRAINING_STATE_FILE, {"host": state["host"], "scaler": state["scaler"]})
    _write_torch(tmp / RNG_FILE, rng_state())
    # meta.json last: a directory with it holds every file the meta lists.
    (tmp / META_FILE).write_bytes(json.dumps(meta, indent=2).encode())
    write_manifest(tmp)  # last of all: it hashes the files as they are on disk


def _write_directory(target: Path, fill: Callable[[Path], None]) -> Path:
    """The one write sequence of every writer here: ``fill`` a fresh temporary directory beside
    ``target``, flush each file and directory in it to disk, then install it under ``target``'s
    name (`_install`). On any failure the temporary directory is removed and ``target`` is left
    as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a checkpoint is an ordinary directory
        fsync_tree(tmp)
        _install(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything that is not a roundpipe checkpoint (or an empty directory)."""
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory; choose another checkpoint path")
    if any(target.iterdir()) and not (target / META_FILE).is_file():
        raise CheckpointError(
            f"{target} exists and is not a roundpipe checkpoint (no {META_FILE}); refusing to replace it. "
            "Choose an empty or new directory"
        )


def _remove_stale_siblings(target: Path) -> None:
    """Leftovers of a save of this same target that crashed (a hard kill skips our cleanup)."""
    for prefix in (TEMP_PREFIX, OLD_PREFIX):
        for stale in target.parent.glob(f"{prefix}{target.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)


def _install(tmp: Path, target: Path) -> None:
    """Make ``tmp`` appear under ``target``'s name, replacing an existing checkpoint.

    Where the OS can swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``) the
    final name always points at a complete checkpoint, old or new. Elsewhere the old one is
    renamed aside first; a crash between the two renames leaves no directory under the final name
    (never a partial one) and the previous checkpoint under the ``.old-`` name beside it.
    """
    if target.exists():
        if _exchange(tmp, target):
            fsync_dir(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous checkpoint
            return
        old = Path(tempfile.mkdtemp(prefix=f"{OLD_PREFIX}{target.name}-", dir=target.parent))
        os.rmdir(old)
        os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, target)
    fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2; False where that is not available."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # no libc symbol (musl before 1.2.4, old glibc)
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _write_torch(path: Path, obj: Any) -> None:
    torch.save(obj, path)


def _fingerprint(pipe: RoundPipe) -> dict[str, Any]:
    """Enough of the model's shape to tell a different model apart without hashing weights."""
    module = pipe.module
    trainable = {
        name: [list(master.shape), str(master.dtype)] for name, _, master in pipe.host.named_masters()
    }
    frozen = {name: list(p.shape) for name, p in module.named_parameters() if not p.requires_grad}
    return {"class": type(module).__name__, "trainable": trainable, "frozen": frozen}


# --------------------------------------------------------------------- loading


def read_checkpoint_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``meta.json`` (step, data_step, config, extra, ...), validated."""
    path = Path(directory)
    if not path.exists():
        hint = ""
        olds = sorted(path.parent.glob(f"{OLD_PREFIX}{path.name}-*")) if path.parent.is_dir() else []
        if olds:
            hint = (
                f"; a save was interrupted while replacing it and the previous checkpoint is at {olds[-1]} "
                f"(rename it to {path} to use it)"
            )
        raise CheckpointError(f"checkpoint {path} does not exist{hint}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        found = run_checkpoints(path)
        hint = f"; it is a run directory: pass its checkpoint, {found[0][1]}" if found else ""
        raise CheckpointError(f"{path} is not a roundpipe checkpoint: {META_FILE} is missing{hint}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
            f"expected {CHECKPOINT_FORMAT!r}"
        )
    check_meta_fields(meta, meta_path)
    missing = [name for name in meta["files"] if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    return meta


def load_checkpoint(
    pipe: RoundPipe, directory: str | os.PathLike[str], *, restore_rng: bool = True
) -> CheckpointInfo:
    """Restore a checkpoint written by `save_checkpoint` into ``pipe`` (same model, same
    sync/async mode) so the run continues exactly as if it had not stopped. Also restores the
    global torch and Python RNG states unless ``restore_rng`` is False."""
    path = Path(directory)
    meta = read_checkpoint_meta(path)
    try:
        verify_checkpoint(path)
    except ManifestMissingError as exc:
        warnings.warn(f"{exc}; loading it unverified", UserWarning, stacklevel=2)
    except CheckpointError as exc:
        raise with_alternative(exc, path) from None
    _check_model(meta["model"], _fingerprint(pipe), path)
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / WEIGHTS_FILE))
        training = _read_torch(path / TRAINING_STATE_FILE)
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "config": meta["config"],
            "step": meta["step"],
            "iteration": meta["iteration"],
            "model": weights,
            "host": training["host"],
            "scaler": training["scaler"],
        }
        if IN_FLIGHT_FILE in meta["files"]:
            state["in_flight_weights"] = load_file(str(path / IN_FLIGHT_FILE))
        rng = _read_torch(path / RNG_FILE) if restore_rng else None
    except (OSError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); it is damaged") from exc
    pipe.load_state_dict(state)
    if rng is not None:
        set_rng_state(rng)
    return CheckpointInfo(
        path=path, step=int(meta["step"]), data_step=int(meta["data_step"]), extra=meta["extra"]
    )


def _read_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors come in many types; all mean the same here
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc


def _check_model(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    problems: list[str] = []
    if saved.get("class") != current["class"]:
        problems.append(f"it was saved from a {saved.get('class')}, this model is a {current['class']}")
    for kind in ("trainable", "frozen"):
        old, new = saved.get(kind, {}), current[kind]
        missing = sorted(set(new) - set(old))
        unexpected = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
        if missing:
            problems.append(f"{len(missing)} {kind} parameters are not in it (e.g. {missing[0]})")
        if unexpected:
            problems.append(
                f"it has {len(unexpected)} {kind} parameters this model lacks (e.g. {unexpected[0]})"
            )
        if changed:
            n = changed[0]
            problems.append(f"{kind} parameter {n} has shape/dtype {old[n]} there but {new[n]} here")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match this model: "
            + "; ".join(problems)
            + ". Build the same model (same preset/config, same LoRA settings) to resume"
        )


# --------------------------------------------------------------------- export


def export_pretrained(pipe: RoundPipe, directory: str | os.PathLike[str], tokenizer: Any = None) -> Path:
    """Save the trained model with its own ``save_pretrained`` (after `synchronize()`), and
    ``tokenizer`` beside it when given (its ``save_pretrained``), so the directory loads whole.

    A transformers model is saved in full (load it with ``AutoModelForCausalLM.from_pretrained``),
    a peft model only its adapters (``PeftModel.from_pretrained(base_model, directory)``). The
    directory appears complete or not at all (written under a temporary name, then renamed)."""
    module = pipe.module
    save: Callable[..., Any] | None = getattr(module, "save_pretrained", None)
    if save is None:
        raise CheckpointError(
            f"cannot export a {type(module).__name__}: it has no save_pretrained (only transformers and peft "
            "models do); use save_checkpoint, or torch.save(pipe.module.state_dict(), path) after synchronize()"
        )
    pipe.synchronize()
    target = check_export_target(directory)

    def write(tmp: Path) -> None:
        from roundpipe.quiet import quiet_libraries

        with quiet_libraries():  # no "Writing model shards" bar in the middle of roundpipe's output
            save(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
        _absolute_base_path(tmp / ADAPTER_CONFIG)

    return _write_directory(target, write)


ADAPTER_CONFIG = "adapter_config.json"  # peft's: names the base model the adapters load onto


def _absolute_base_path(path: Path) -> None:
    """Make the base model an adapter export names loadable from any directory: peft records the
    path as it was typed (``tiny-model``), which from elsewhere reads as a Hub name. A relative
    path that exists here becomes absolute; a Hub name or an absolute path stays as it is."""
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base or Path(base).is_absolute() or not Path(base).exists():
        return
    config["base_model_name_or_path"] = str(Path(base).resolve())
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointInfo",
    "export_pretrained",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
]
