"""The manifest that lets a checkpoint prove it is the one that was written.

Why a module of its own: a checkpoint directory can be damaged after it was written (a truncated
copy, a flipped block on disk, a deleted file), and loading such a directory must fail with one
line naming the file instead of a deserialiser's traceback or, worse, loading NaNs silently.
``manifest.json`` records the size and sha256 of every other file; it is written last, inside the
temporary directory that `roundpipe.checkpoint` then installs atomically, so it always describes
exactly the files beside it. The types of the ``meta.json`` fields a loader reads are checked here
too (`check_meta_fields`), so an edited field is named instead of failing deep in the loader.
`roundpipe checkpoint verify` uses this module alone, so it must
never import torch (the schedule commands and `roundpipe --help` run where torch is absent).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from roundpipe.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "roundpipe.manifest/1"
_CHUNK = 1 << 20


class ManifestMissingError(CheckpointError):
    """The checkpoint predates manifests (or lost its manifest): nothing to verify against."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> Path:
    """Record size and sha256 of every file in ``directory`` (read back from disk, so the
    manifest describes what was written) into ``manifest.json``; call it after the last file."""
    files = {
        child.name: {"size": child.stat().st_size, "sha256": file_digest(child)}
        for child in sorted(directory.iterdir())
        if child.is_file() and child.name != MANIFEST_FILE
    }
    target = directory / MANIFEST_FILE
    target.write_bytes(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2).encode())
    return target


def verify_checkpoint(directory: str | os.PathLike[str]) -> int:
    """Check every file the manifest lists; return how many were checked. Raises
    `ManifestMissingError` when there is no manifest and `CheckpointError` naming the first
    damaged file (missing, size differs, hash differs) or an unreadable manifest."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ManifestMissingError(
            f"checkpoint {path}: {MANIFEST_FILE} is missing (written before manifests existed, or damaged); "
            "its files cannot be verified"
        )
    files = _read_manifest(manifest_path)
    for name, expected in files.items():
        _check_file(path / name, expected, manifest_path)
    return len(files)


def _read_manifest(manifest_path: Path) -> dict[str, dict[str, Any]]:
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable ({exc}); the checkpoint is damaged") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
        or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise CheckpointError(
            f"{manifest_path} is unreadable (not a {MANIFEST_FORMAT} manifest); the checkpoint is damaged"
        )
    return files


def _check_file(file: Path, expected: dict[str, Any], manifest_path: Path) -> None:
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing (listed in {manifest_path.name})")
    size = file.stat().st_size
    if size != expected["size"]:
        raise CheckpointError(
            f"checkpoint file {file} is damaged: size {size} bytes, the manifest says {expected['size']}"
        )
    if file_digest(file) != expected["sha256"]:
        raise CheckpointError(
            f"checkpoint file {file} is damaged: its sha256 differs from the manifest's (same size, changed content)"
        )


# The fields of meta.json the loader reads, and the JSON type each must have.
_META_FIELDS: dict[str, tuple[type, str]] = {
    "step": (int, "a whole number >= 0"),
    "iteration": (int, "a whole number >= 0"),
    "data_step": (int, "a whole number >= 0"),
    "files": (list, "a list of file names"),
    "config": (dict, "an object"),
    "model": (dict, "an object"),
    "extra": (dict, "an object"),
}


def check_meta_fields(meta: dict[str, Any], meta_path: Path) -> None:
    """Every field the loader reads has the right type: an edited or damaged meta.json is named
    with its field, never met later as an ``int()`` error."""
    for name, (kind, text) in _META_FIELDS.items():
        value: Any = meta.get(name)
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if ok and isinstance(value, int):
            ok = value >= 0
        if ok and isinstance(value, list):
            ok = all(isinstance(item, str) for item in value)
        if not ok:
            got = "missing" if name not in meta else f"got {value!r}"
            raise CheckpointError(
                f"{meta_path}: field {name!r} must be {text} ({got}); the checkpoint is damaged or was "
                "edited: use another checkpoint (roundpipe checkpoint verify DIR checks one)"
            )


__all__ = [
    "MANIFEST_FILE",
    "ManifestMissingError",
    "check_meta_fields",
    "verify_checkpoint",
    "write_manifest",
]
