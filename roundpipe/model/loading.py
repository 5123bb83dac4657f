"""A transformers model directory loaded shard by shard straight into roundpipe's host layout.

Why not ``from_pretrained``: it builds the whole model in one dtype and hands it over, so a 70B
base is whole in host memory (141 GB in bf16) before roundpipe turns its frozen weights into the
compute copy (or 4-bit). Here the module skeleton is built with its parameters on the meta device
(no bytes), then each shard is mapped and every tensor installed as it arrives:

- a frozen tensor whose file dtype is the compute dtype is a **view of the mapped file** (no
  private copy; the page cache holds it, `roundpipe.optim.host.HostModel` uses it as is on CPU
  workers, and on CUDA copies it once into its pinned arena, releasing the mapping shard by shard);
- a trainable tensor (or a frozen one in another dtype) is copied into the dtype it is kept in,
  and its file pages leave the process at once;
- with ``base_format="nf4"`` each frozen linear layer is quantized as soon as its weight has
  arrived, and the bf16 pages leave the process with it.

Tied parameters (an LM head sharing the embedding) stay one ``nn.Parameter``; a checkpoint that
leaves out the tied copy (as ``save_pretrained`` does) loads. Missing or unexpected tensors, shapes
that disagree with config.json and unreadable files are `ModelError`s naming the tensor and file.

This module must never hold a whole checkpoint in memory, never reach the network, and never
draw anything: progress goes to the caller's callback.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model.installing import FrozenRule, Installer, LoadReport
from roundpipe.model.shards import MappedShard, checkpoint_files, read_header


@dataclass
class LoadProgress:
    """Where a load stands, handed to the progress callback after every tensor."""

    file: str
    file_index: int
    files: int
    bytes_done: int
    bytes_total: int


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lands on the meta device (no memory, and the initialiser
    that follows runs on nothing); buffers stay real, so computed non-persistent ones such as the
    rotary ``inv_freq`` keep their values."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            made = module._parameters[name]
            assert made is not None
            module._parameters[name] = type(made)(made.to("meta"), requires_grad=made.requires_grad)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def model_skeleton(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _tell(
    progress: Callable[[LoadProgress], None] | None,
    file: Path,
    index: int,
    files: int,
    done: int,
    *,
    total: int,
) -> None:
    if progress is not None:
        progress(LoadProgress(file.name, index, files, done, total))


def _load_file(
    loader: Installer, file: Path, names: list[str], done: int, tell: Callable[[int], None]
) -> int:
    """Install the tensors ``names`` of shard ``file`` in file order; returns the bytes done.
    The mapping outlives this call only through the views installed from it."""
    shard = MappedShard(file)
    shard.prefetch()
    absent = [n for n in names if n not in shard.entries]
    if absent:
        raise ModelError(
            f"{file.name} lacks {len(absent)} tensor(s) the index assigns to it ({', '.join(absent[:4])}); "
            "the shard is incomplete or the index belongs to another checkpoint"
        )
    entries = shard.entries
    for name in sorted(names, key=lambda n: entries[n].start):
        loader.put(shard, name)
        done += shard.nbytes(name)
        tell(done)
    loader.quantize_ready()
    return done


def load_weights(
    model: nn.Module,
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    frozen: FrozenRule = False,
    frozen_dtype: torch.dtype | None = None,
    base_format: str = "compute",
    progress: Callable[[LoadProgress], None] | None = None,
) -> LoadReport:
    """Install the safetensors checkpoint of ``directory`` into ``model`` (a skeleton from
    `model_skeleton`), shard by shard; see the module docstring. ``frozen`` (all, or per checkpoint
    name) says which parameters stay frozen: they are kept in ``frozen_dtype`` (default ``dtype``)
    as views of the files where the dtypes agree; the others are copied into ``dtype`` and train.
    ``base_format="nf4"`` quantizes each frozen linear as it arrives (the rules of
    `roundpipe.model.quant.quantize_frozen_`; with LoRA, add the adapters to the skeleton first)."""
    path = Path(directory).expanduser()
    files = checkpoint_files(path)
    loader = Installer(
        model, dtype=dtype, frozen=frozen, frozen_dtype=frozen_dtype or dtype, base_format=base_format
    )
    loader.slots.check(model, files, path)
    total = 0
    for file, names in files.items():
        entries = read_header(file)
        total += sum(entries[n].end - entries[n].start for n in names if n in entries)
    done = 0
    start = time.perf_counter()
    for index, (file, names) in enumerate(files.items()):
        tell = functools.partial(_tell, progress, file, index, len(files), total=total)
        done = _load_file(loader, file, names, done, tell)
    left = [name for ident, name in loader.slots.names.items() if ident not in loader.loaded]
    if left:
        raise ModelError(f"{path}: {len(left)} parameter(s) were not loaded ({', '.join(left[:4])})")
    loader.report.files = len(files)
    loader.report.seconds = time.perf_counter() - start
    return loader.report


def load_skeleton_config(path: Path) -> Any:
    """The transformers config saved in directory ``path`` (never from the network)."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelError(f"directory {path} has no config.json; save the model with save_pretrained(dir)")
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError) as exc:
        raise ModelError(f"{path}/config.json cannot be read as a transformers config: {exc}") from exc


def load_pretrained(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    frozen: FrozenRule = False,
    frozen_dtype: torch.dtype | None = None,
    base_format: str = "compute",
    progress: Callable[[LoadProgress], None] | None = None,
) -> tuple[nn.Module, LoadReport]:
    """The causal LM saved in ``directory`` (config.json + safetensors, sharded or not), loaded by
    `load_weights` into a meta skeleton, in eval mode as ``from_pretrained`` returns it."""
    path = Path(directory).expanduser()
    model = model_skeleton(load_skeleton_config(path), dtype)
    report = load_weights(
        model,
        path,
        dtype=dtype,
        frozen=frozen,
        frozen_dtype=frozen_dtype,
        base_format=base_format,
        progress=progress,
    )
    model.eval()
    return model, report


__all__ = [
    "FrozenRule",
    "LoadProgress",
    "LoadReport",
    "load_pretrained",
    "load_skeleton_config",
    "load_weights",
    "model_skeleton",
    "parameters_on_meta",
]
