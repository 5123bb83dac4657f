"""How one checkpoint tensor becomes a parameter of a meta skeleton (`roundpipe.model.loading`).

Why apart from the loading loop: the decisions per tensor (view or copy, which dtype, a tied
second name, a finished frozen linear to quantize) and the bytes they cost are the whole memory
story of a load, and read best in one place. A frozen tensor in the dtype it is kept in stays a
view of the mapped file; anything else is copied and its file pages leave the process at once;
a frozen linear is quantized (``base_format="nf4"``) as soon as all its parameters have arrived,
with the rules of `roundpipe.model.quant.quantize_frozen_`.

This module must never keep a copy of a tensor next to the view it came from, nor quantize a
layer before every one of its parameters is loaded.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from roundpipe.errors import ConfigError, ModelError
from roundpipe.model.nf4 import DEFAULT_BLOCK_SIZE
from roundpipe.model.quant import NF4Linear, kept_modules
from roundpipe.model.shards import MappedShard

FrozenRule = bool | Callable[[str], bool]


@dataclass
class LoadReport:
    """What a load did. ``mapped_bytes`` stay views of the files (page cache, no private copy);
    ``copied_bytes`` were made in host memory (trainable weights, dtype conversions);
    ``quantized_bytes`` are the file bytes of weights now held quantized (``nf4_bytes`` of them)."""

    files: int = 0
    tensors: int = 0
    file_bytes: int = 0
    mapped_bytes: int = 0
    copied_bytes: int = 0
    quantized_bytes: int = 0
    nf4_bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # tied second names holding the same values
    untied: list[str] = field(default_factory=list)  # tied second names whose files hold other values

    def rate_gbps(self) -> float:
        return self.file_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def checkpoint_name(name: str) -> str:
    """The name a parameter of a peft-wrapped layer has in a plain checkpoint."""
    return name.replace(".base_layer.", ".")


class Slots:
    """Where each parameter to load lives: per checkpoint name, the parameter's identity and
    every (module, attribute) holding it, so a tied pair is replaced as one. Parameters already
    real (peft adapters initialised on the skeleton) are not asked of the files."""

    def __init__(self, model: nn.Module) -> None:
        self.ident: dict[str, int] = {}
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        self.names: dict[int, str] = {}  # the first (canonical) name of each parameter
        self.holder_of: dict[str, tuple[nn.Module, str]] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                if param is None or param.device.type != "meta":
                    continue
                name = checkpoint_name(f"{prefix}.{attr}" if prefix else attr)
                self.ident[name] = id(param)
                self.holders.setdefault(id(param), []).append((module, attr))
                self.holder_of[name] = (module, attr)
                self.names.setdefault(id(param), name)
        self.buffers = {
            checkpoint_name(name): buf
            for name, buf in model.state_dict(keep_vars=True).items()
            if not isinstance(buf, nn.Parameter)
        }

    def placeholder(self, ident: int) -> nn.Parameter:
        module, attr = self.holders[ident][0]
        param = module._parameters[attr]
        assert param is not None
        return param

    def install(self, ident: int, value: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        param = nn.Parameter(value, requires_grad=requires_grad)
        for module, attr in self.holders[ident]:
            module._parameters[attr] = param
        return param

    def check(self, model: nn.Module, files: dict[Path, list[str]], where: Path) -> None:
        """`ModelError` for tensors of the files the model has no place for, and for parameters
        no file provides (a tied parameter is provided by any of its names)."""
        in_files = {name for names in files.values() for name in names}
        ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unexpected = sorted(
            n
            for n in in_files
            if n not in self.ident and n not in self.buffers and not any(p.search(n) for p in ignore)
        )
        provided = {self.ident[n] for n in in_files if n in self.ident}
        missing = sorted(name for ident, name in self.names.items() if ident not in provided)
        if not unexpected and not missing:
            return
        parts = [
            f"{len(names)} {what} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            for what, names in (("missing", missing), ("unexpected", unexpected))
            if names
        ]
        raise ModelError(
            f"the checkpoint in {where} does not match the {type(model).__name__} its config.json builds: "
            f"{'; '.join(parts)} tensors. Was it saved by another model class or transformers version? "
            "Re-save it with save_pretrained, or load it with AutoModelForCausalLM.from_pretrained"
        )


def _quantizable(model: nn.Module, block_size: int) -> set[int]:
    """The plain ``nn.Linear`` modules `quantize_frozen_` would quantize once frozen: not one it
    keeps (`roundpipe.model.quant.kept_modules`: the LM head, one sharing a weight), not a
    subclass, and of a size that splits into blocks."""
    kept = kept_modules(model, include_lm_head=False)
    return {
        id(module)
        for module in model.modules()
        if type(module) is nn.Linear and id(module) not in kept and module.weight.numel() % block_size == 0
    }


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``). Quantizing leaves
    its freed scratch in the heap between kept tensors; without this the resident size keeps
    what the next shard will reuse only in part. Nothing happens where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Installer:
    """One load in progress: installs tensors, quantizes finished frozen linears, counts bytes."""

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype,
        frozen: FrozenRule,
        frozen_dtype: torch.dtype,
        base_format: str = "compute",
    ) -> None:
        if base_format not in ("compute", "nf4"):
            raise ConfigError(f"unknown base_format {base_format!r}; use 'compute' or 'nf4'")
        self.model = model
        self.slots = Slots(model)
        self.dtype = dtype
        self.frozen = frozen
        self.frozen_dtype = frozen_dtype
        self.report = LoadReport()
        self.loaded: set[int] = set()  # identities (of the skeleton's placeholders) installed
        self.nf4 = base_format == "nf4"
        self.block_size = DEFAULT_BLOCK_SIZE
        self.to_quantize = _quantizable(model, self.block_size) if self.nf4 else set()
        # Frozen linear weights (by installed parameter) waiting for their layer to be complete.
        self.waiting: dict[int, tuple[MappedShard, str, bool]] = {}

    def _is_frozen(self, name: str) -> bool:
        return self.frozen(name) if callable(self.frozen) else self.frozen

    def put(self, shard: MappedShard, name: str) -> None:
        """Install tensor ``name`` of ``shard`` where the model holds it."""
        source = shard.tensor(name)
        self.report.file_bytes += shard.nbytes(name)
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
        expected = self.slots.placeholder(ident).shape
        if tuple(source.shape) != tuple(expected):
            raise ModelError(
                f"tensor {name!r} in {shard.path.name} has shape {list(source.shape)} but the model built "
                f"from config.json expects {list(expected)}: config.json and the weights disagree"
            )
        floating = source.is_floating_point()
        frozen = self._is_frozen(name) or not floating
        target = (self.frozen_dtype if frozen else self.dtype) if floating else source.dtype
        if frozen and source.dtype == target:
            value = source  # a view of the mapped file
            self.report.mapped_bytes += shard.nbytes(name)
        else:
            value = source.to(target, copy=True)
            self.report.copied_bytes += value.numel() * value.element_size()
            shard.release(name)
        param = self.slots.install(ident, value, requires_grad=not frozen)
        self.loaded.add(ident)
        module, attr = self.slots.holders[ident][0]
        if frozen and floating and attr == "weight" and id(module) in self.to_quantize:
            self.waiting[id(param)] = (shard, name, value is source)

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
        self.to_quantize.discard(id(module))  # now that the head has a weight of its own: as kept
        self.report.untied.append(name)
        self.report.copied_bytes += value.numel() * value.element_size()
        shard.release(name)

    def quantize_ready(self) -> None:
        """Quantize every frozen linear whose parameters have all arrived, then let the pages
        of its dense weight go (or drop its copy)."""
        if not self.waiting:
            return
        for prefix, module in list(self.model.named_modules()):
            if id(module) not in self.to_quantize or id(module.weight) not in self.waiting:
                continue
            if any(p.device.type == "meta" or p.requires_grad for p in module.parameters(recurse=False)):
                continue
            shard, name, mapped = self.waiting.pop(id(module.weight))
            replacement = NF4Linear.from_linear(module, self.block_size)
            parent_name, _, child = prefix.rpartition(".")
            setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, replacement)
            if mapped:
                self.report.mapped_bytes -= shard.nbytes(name)
            else:
                self.report.copied_bytes -= module.weight.numel() * module.weight.element_size()
            self.report.quantized_bytes += shard.nbytes(name)
            self.report.nf4_bytes += sum(p.numel() * p.element_size() for p in replacement.parameters())
            module.to("meta")
            shard.release(name)
        trim_heap()


__all__ = ["FrozenRule", "Installer", "LoadReport", "Slots", "checkpoint_name"]
