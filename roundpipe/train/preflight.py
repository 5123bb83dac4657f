"""Checks of `roundpipe train`'s options that cost neither a model nor a pass over the data.

Why apart: a mistyped ``--model`` or ``--data`` must be reported first, in the words the user
typed, not after the data was tokenized with some other tokenizer nor after a model was built.
Everything here reads at most a few small files (a config.json, a checkpoint's meta.json) and
says what to change; it must never build a model, load weights or read the data itself.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roundpipe.errors import ModelError
from roundpipe.train.config import TrainConfig


@dataclass(frozen=True)
class ModelFacts:
    """What the run needs to know about its model before building it."""

    max_positions: int | None  # the config's max_position_embeddings (None: not stated)


def check_model(config: TrainConfig) -> ModelFacts:
    """The model ``--model`` names exists (a preset, a config.json, or a directory holding one);
    raises `ModelError` saying what was expected, with the closest names when it looks mistyped."""
    from roundpipe.model.presets import PRESETS, preset_config

    name = config.model
    if name in PRESETS:
        return ModelFacts(_positions(preset_config(name).to_dict()))
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(
                f"--model {name!r}: the directory has no config.json; give a directory written by "
                "save_pretrained (config.json, weights, tokenizer), a config.json, or a preset "
                f"({', '.join(sorted(PRESETS))})"
            )
    if path.is_file():
        return ModelFacts(_positions(_read_json(path)))
    raise ModelError(
        f"unknown model {name!r} (--model): no such directory or file, and not a preset "
        f"({', '.join(sorted(PRESETS))})" + _did_you_mean(path, sorted(PRESETS))
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"--model: {path} is not a readable JSON file ({exc}); give a transformers config.json"
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelError(
            f"--model: {path} has no 'model_type'; give a transformers config.json (from save_pretrained)"
        )
    return data


def _positions(config: dict[str, Any]) -> int | None:
    """max_position_embeddings of a config (or of its text model's, for multimodal configs)."""
    for source in (config, config.get("text_config") or {}):
        value = source.get("max_position_embeddings") if isinstance(source, dict) else None
        if isinstance(value, int) and value > 1:
            return value
    return None


def _did_you_mean(path: Path, presets: list[str]) -> str:
    """``; did you mean ...?`` naming the closest existing siblings or presets, or nothing."""
    parent = path.parent if str(path.parent) else Path(".")
    siblings: list[str] = []
    if parent.is_dir():
        try:
            siblings = [p.name for p in parent.iterdir() if p.is_dir() or p.suffix == ".json"]
        except OSError:
            siblings = []
    close = difflib.get_close_matches(path.name, siblings, n=2, cutoff=0.75)
    names = [str(path.with_name(c)) if str(path.parent) not in ("", ".") else c for c in close]
    if str(path).startswith("./"):
        names = ["./" + n if not n.startswith(("./", "/")) else n for n in names]
    names += difflib.get_close_matches(path.name, presets, n=1, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(n) for n in names)}?" if names else ""


__all__ = ["ModelFacts", "check_model"]
