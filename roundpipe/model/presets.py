"""Named built-in model configurations and ``build_model``.

Examples, tests and the CLI need small models that train in seconds on a laptop CPU without any
download (the model hub is not reachable everywhere). This module names a few tiny configs with the
byte-level vocabulary of ``roundpipe.data`` and builds a model from a preset name, a local
``config.json`` or a local model directory (random init, or the directory's weights when it has
them). It must never reach the network, never touch the caller's global RNG state, and never return
a model that ``to_layer_sequence`` cannot split.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError

BYTE_VOCAB_SIZE = 256
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _qwen3_tiny() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )


def _llama_tiny() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )


PRESETS: dict[str, Callable[[], Any]] = {
    "qwen3-tiny": _qwen3_tiny,
    "llama-tiny": _llama_tiny,
}


def preset_config(name: str) -> Any:
    """A fresh transformers config for the preset ``name``."""
    if name not in PRESETS:
        raise ModelError(
            f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) nor an existing local "
            "config.json file or directory containing config.json"
        )
    return PRESETS[name]()


def _config_from_file(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); give a transformers config.json") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelError(
            f"{path} has no 'model_type'; give a transformers config.json (e.g. from save_pretrained)"
        )
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ModelError(f"{path}: transformers does not know model_type {model_type!r} ({exc})") from exc


def build_model(
    name_or_path: str | os.PathLike[str],
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build a causal LM from a preset name, a local config.json, or a local model directory.

    Random init is seeded by ``seed`` (the caller's RNG state is left untouched). A directory that
    also holds weights (``model.safetensors`` / ``pytorch_model.bin``, possibly sharded) is loaded with
    ``from_pretrained``. ``vocab_size`` overrides the config's vocabulary (random init only).
    """
    from transformers import AutoModelForCausalLM

    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ModelError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    name = os.fspath(name_or_path)
    path = Path(name)
    if isinstance(name_or_path, str) and name in PRESETS:
        config = preset_config(name)
    elif path.is_file():
        config = _config_from_file(path)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"directory {path} has no config.json; save the model with save_pretrained(dir)")
        if any((path / w).is_file() for w in WEIGHT_FILES):
            if vocab_size is not None:
                raise ModelError(
                    f"{path} holds trained weights; vocab_size cannot be changed when loading them "
                    "(leave vocab_size=None, or pass only the config.json for a random init)"
                )
            from roundpipe.quiet import quiet_libraries

            with quiet_libraries():  # no "Loading weights" bar in the caller's output
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
            return model
        config = _config_from_file(path / "config.json")
    else:
        config = preset_config(name)  # raises the "unknown model" error

    if vocab_size is not None:
        config.vocab_size = vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model
