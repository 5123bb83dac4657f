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

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model.shards import MappedShard, checkpoint_files, read_header

FrozenRule = bool | Callable[[str], bool]


@dataclass
class LoadProgress:
    """Where a load stands, handed to the progress callback after every tensor."""

    file: str
    file_index: int
    files: int
    bytes_done: int
    bytes_total: int


@dataclass
class LoadReport:
    """What a load did. ``mapped_bytes`` stay views of the files (page cache, no private copy);
    ``copied_bytes`` were made in host memory (trainable weights, dtype conversions);
    ``quantized_bytes`` are the file bytes of weights held quantized instead."""

    files: int = 0
    tensors: int = 0
    file_bytes: int = 0
    mapped_bytes: int = 0
    copied_bytes: int = 0
    quantized_bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # tied copies present in the files
    untied: list[str] = field(default_factory=list)  # tied names whose files hold other values

    def rate_gbps(self) -> float:
        return self.file_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


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

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
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


class _Slots:
    """Where each parameter of a model lives: per checkpoint name, the parameter's identity and
    every (module, attribute) holding it, so a tied pair is replaced as one."""

    def __init__(self, model: nn.Module) -> None:
        self.ident: dict[str, int] = {}
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        self.names: dict[int, str] = {}  # the first (canonical) name of each parameter
        self.holder_of: dict[str, tuple[nn.Module, str]] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                self.ident[name] = id(param)
                self.holders.setdefault(id(param), []).append((module, attr))
                self.holder_of[name] = (module, attr)
                self.names.setdefault(id(param), name)
        self.buffers = {
            name: buf for name, buf in model.state_dict(keep_vars=True).items() if name not in self.ident
        }

    def install(self, ident: int, value: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        param = nn.Parameter(value, requires_grad=requires_grad)
        for module, attr in self.holders[ident]:
            module._parameters[attr] = param
        return param


def _check_keys(model: nn.Module, slots: _Slots, files: dict[Path, list[str]], where: Path) -> None:
    """`ModelError` for tensors of the files the model has no place for, and for parameters no
    file provides (a tied parameter is provided by any of its names)."""
    in_files = {name for names in files.values() for name in names}
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = sorted(
        n
        for n in in_files
        if n not in slots.ident and n not in slots.buffers and not any(p.search(n) for p in ignore)
    )
    provided = {slots.ident[n] for n in in_files if n in slots.ident}
    missing = sorted(name for ident, name in slots.names.items() if ident not in provided)
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
            )
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''})"
            )
        raise ModelError(
            f"the checkpoint in {where} does not match the {type(model).__name__} its config.json builds: "
            f"{'; '.join(parts)} tensors. Was it saved by another model class or transformers version? "
            "Re-save it with save_pretrained, or load it with AutoModelForCausalLM.from_pretrained"
        )


def _is_frozen(rule: FrozenRule, name: str) -> bool:
    return rule(name) if callable(rule) else rule


class _Loader:
    """One load in progress: installs tensors, quantizes finished frozen linears, counts bytes."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype,
        frozen: FrozenRule,
        frozen_dtype: torch.dtype,
        quantize: Callable[[nn.Module], nn.Module] | None,
    ) -> None:
        self.model = model
        self.slots = _Slots(model)
        self.dtype = dtype
        self.frozen = frozen
        self.frozen_dtype = frozen_dtype
        self.quantize = quantize
        self.report = LoadReport()
        self.loaded: set[int] = set()

    def put(self, shard: MappedShard, name: str) -> None:
        """Install tensor ``name`` of ``shard`` where the model holds it."""
        source = shard.tensor(name)
        nbytes = shard.nbytes(name)
        self.report.file_bytes += nbytes
        self.report.tensors += 1
        if name in self.slots.buffers:
            with torch.no_grad():
                self.slots.buffers[name].copy_(source)
            shard.release(name)
            return
        ident = self.slots.ident[name]
        if ident in self.loaded:
            self._tied_copy(shard, name, ident, source)
            return
        expected = self.slots.holders[ident][0][0]._parameters[self.slots.holders[ident][0][1]]
        assert expected is not None
        if tuple(source.shape) != tuple(expected.shape):
            raise ModelError(
                f"tensor {name!r} in {shard.path.name} has shape {list(source.shape)} but the model built "
                f"from config.json expects {list(expected.shape)}: config.json and the weights disagree"
            )
        frozen = _is_frozen(self.frozen, name) or not source.is_floating_point()
        target = (self.frozen_dtype if frozen else self.dtype) if source.is_floating_point() else source.dtype
        if frozen and source.dtype == target:
            value = source  # a view of the mapped file
            self.report.mapped_bytes += nbytes
            if self.quantize is not None and name.endswith(".weight") and source.dim() == 2:
                self.waiting[ident] = (shard, name)
        else:
            value = source.to(target, copy=True)
            self.report.copied_bytes += value.numel() * value.element_size()
            shard.release(name)
        self.slots.install(ident, value, requires_grad=not frozen)
        self.loaded.add(ident)

    def _tied_copy(self, shard: MappedShard, name: str, ident: int, source: torch.Tensor) -> None:
        """A second name of a tied parameter in the files: skipped when it holds the same values;
        otherwise ``name`` gets a parameter of its own, as transformers unties such a pair."""
        module, attr = self.slots.holder_of[name]
        installed = module._parameters[attr]
        assert installed is not None
        if torch.equal(source.to(installed.dtype), installed.detach()):
            self.report.skipped.append(name)
            shard.release(name)
            return
        value = source.to(installed.dtype, copy=True)
        module._parameters[attr] = nn.Parameter(value, requires_grad=installed.requires_grad)
        self.slots.holders[ident].remove((module, attr))
        self.report.untied.append(name)
        self.report.copied_bytes += value.numel() * value.element_size()
        shard.release(name)

    def quantize_ready(self) -> None:
        """Quantize every frozen linear layer whose parameters have all arrived (the one step that
        turns a frozen base into its stored format), then let the bf16 pages go."""
        if self.quantize is None or not self.waiting:
            return
        for prefix, module in list(self.model.named_modules()):
            weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
            if weight is None or id(weight) not in self.waiting:
                continue
            if any(id(p) not in self.loaded for p in module.parameters(recurse=False)):
                continue
            shard, name = self.waiting.pop(id(weight))
            self._replace(prefix, self.quantize(module))
            self.report.mapped_bytes -= shard.nbytes(name)
            self.report.quantized_bytes += shard.nbytes(name)
            shard.release(name)

    def _replace(self, prefix: str, new: nn.Module) -> None:
        parent_name, _, child = prefix.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        setattr(parent, child, new)


def _tell(
    progress: Callable[[LoadProgress], None] | None, file: Path, index: int, files: int, done: int, total: int
) -> None:
    if progress is not None:
        progress(LoadProgress(file.name, index, files, done, total))


def _load_file(loader: _Loader, file: Path, names: list[str], done: int, tell: Callable[[int], None]) -> int:
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
    quantize: Callable[[nn.Module], nn.Module] | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
) -> LoadReport:
    """Install the safetensors checkpoint of ``directory`` into ``model`` (a skeleton from
    `model_skeleton`), shard by shard; see the module docstring. ``frozen`` (all, or per checkpoint
    name) says which parameters stay frozen: they are kept in ``frozen_dtype`` (default ``dtype``)
    as views of the files where the dtypes agree; the others are copied into ``dtype`` and train.
    ``quantize`` turns a loaded frozen ``nn.Linear`` into its stored format."""
    path = Path(directory).expanduser()
    files = checkpoint_files(path)
    loader = _Loader(model, dtype=dtype, frozen=frozen, frozen_dtype=frozen_dtype or dtype, quantize=quantize)
    _check_keys(model, loader.slots, files, path)
    total = 0
    for file, names in files.items():
        entries = read_header(file)
        total += sum(entries[n].end - entries[n].start for n in names if n in entries)
    done = 0
    start = time.perf_counter()
    for index, (file, names) in enumerate(files.items()):
        done = _load_file(
            loader, file, names, done, lambda d, i=index, f=file: _tell(progress, f, i, len(files), d, total)
        )
    left = [name for ident, name in loader.slots.names.items() if ident not in loader.loaded]
    if left:
        raise ModelError(f"{path}: {len(left)} parameter(s) were not loaded ({', '.join(left[:4])})")
    loader.report.files = len(files)
    loader.report.seconds = time.perf_counter() - start
    return loader.report


def load_pretrained(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    frozen: FrozenRule = False,
    frozen_dtype: torch.dtype | None = None,
    quantize: Callable[[nn.Module], nn.Module] | None = None,
    progress: Callable[[LoadProgress], None] | None = None,
) -> tuple[nn.Module, LoadReport]:
    """The causal LM saved in ``directory`` (config.json + safetensors, sharded or not), loaded by
    `load_weights` into a meta skeleton, in eval mode as ``from_pretrained`` returns it."""
    from transformers import AutoConfig

    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(f"directory {path} has no config.json; save the model with save_pretrained(dir)")
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError) as exc:
        raise ModelError(f"{path}/config.json cannot be read as a transformers config: {exc}") from exc
    model = model_skeleton(config, dtype)
    report = load_weights(
        model,
        path,
        dtype=dtype,
        frozen=frozen,
        frozen_dtype=frozen_dtype,
        quantize=quantize,
        progress=progress,
    )
    model.eval()
    return model, report


__all__ = [
    "LoadProgress",
    "LoadReport",
    "load_pretrained",
    "load_weights",
    "model_skeleton",
    "parameters_on_meta",
]
