"""Per-layer costs: the only input the planner needs about a model.

A profiler (or a user, or a test) fills a `LayerCosts` with each layer's forward time, backward
time without recompute, and device memory; the partitioner and the fake backend read stage costs
from it. It validates once, on construction, so every later sum can trust its numbers, and it
reads and writes a small JSON file so costs can be profiled once and reused. It must never measure
anything itself, touch a device, or import torch: it is plain data with sums.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import PlanError

_KEYS = ("fwd_ms", "bwd_ms", "mem_bytes", "names")
_REQUIRED = ("fwd_ms", "bwd_ms", "mem_bytes")


def layer_label(index: int, names: Sequence[str] | None) -> str:
    """``layer 3 ('model.layers.2')`` when names are known, else ``layer 3``: how errors name a layer."""
    if names is not None and 0 <= index < len(names):
        return f"layer {index} ({names[index]!r})"
    return f"layer {index}"


def _as_time(field: str, index: int, value: object, names: Sequence[str] | None) -> float:
    where = f"{field}[{index}] of {layer_label(index, names)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{where} is {value!r} ({type(value).__name__}); give a number of milliseconds >= 0")
    x = float(value)
    if not math.isfinite(x) or x < 0.0:
        raise PlanError(
            f"{where} is {value!r}; every time must be a finite number of milliseconds >= 0 "
            "(re-profile the layer, or replace the measurement)"
        )
    return x


def _as_bytes(index: int, value: object, names: Sequence[str] | None) -> int:
    where = f"mem_bytes[{index}] of {layer_label(index, names)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{where} is {value!r} ({type(value).__name__}); give a whole number of bytes >= 0")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise PlanError(f"{where} is {value!r}; give a whole number of bytes >= 0")
    n = int(value)
    if n < 0:
        raise PlanError(f"{where} is {n}; memory cannot be negative: give the bytes the layer needs (>= 0)")
    return n


@dataclass(frozen=True)
class LayerCosts:
    """Forward/backward milliseconds per microbatch and device bytes, one entry per layer.

    ``bwd_ms`` is the backward *without* recompute; a backward stage pays forward + backward
    (it recomputes), and so does the fused stage (its forward is the recompute).
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    mem_bytes: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        names: tuple[str, ...] | None = None
        if self.names is not None:
            if isinstance(self.names, str) or not isinstance(self.names, Sequence):
                raise PlanError(f"names must be a list of strings (one per layer), got {self.names!r}")
            names = tuple(self.names)
            for i, name in enumerate(names):
                if not isinstance(name, str):
                    raise PlanError(f"names[{i}] is {name!r}; layer names must be strings")
        columns = {"fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms, "mem_bytes": self.mem_bytes}
        for field, column in columns.items():
            if isinstance(column, (str, bytes)) or not isinstance(column, Sequence):
                raise PlanError(f"{field} must be a list with one number per layer, got {column!r}")
        lengths = {field: len(column) for field, column in columns.items()}
        if names is not None:
            lengths["names"] = len(names)
        if len(set(lengths.values())) != 1:
            shown = ", ".join(f"{k}={v}" for k, v in lengths.items())
            raise PlanError(f"layer cost lists differ in length ({shown}); give one entry per layer in each")
        if lengths["fwd_ms"] == 0:
            raise PlanError("layer costs are empty; a model needs at least 1 layer")
        fwd = tuple(_as_time("fwd_ms", i, v, names) for i, v in enumerate(self.fwd_ms))
        bwd = tuple(_as_time("bwd_ms", i, v, names) for i, v in enumerate(self.bwd_ms))
        mem = tuple(_as_bytes(i, v, names) for i, v in enumerate(self.mem_bytes))
        object.__setattr__(self, "fwd_ms", fwd)
        object.__setattr__(self, "bwd_ms", bwd)
        object.__setattr__(self, "mem_bytes", mem)
        object.__setattr__(self, "names", names)

    @property
    def num_layers(self) -> int:
        return len(self.fwd_ms)

    def label(self, index: int) -> str:
        """How messages name layer ``index``: ``layer 3 ('model.layers.2')``."""
        return layer_label(index, self.names)

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        fwd_ms: float = 1.0,
        bwd_ms: float = 2.0,
        mem_bytes: int = 0,
        head_factor: float = 1.0,
    ) -> LayerCosts:
        """``num_layers`` identical layers, the last one (an LM head) scaled by ``head_factor``.

        The head's forward, backward and memory are all multiplied (memory rounded to whole bytes).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise PlanError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if isinstance(head_factor, bool) or not isinstance(head_factor, (int, float)):
            raise PlanError(f"head_factor must be a number >= 0, got {head_factor!r}")
        if not math.isfinite(head_factor) or head_factor < 0:
            raise PlanError(f"head_factor must be a finite number >= 0, got {head_factor!r}")
        fwd = [fwd_ms] * num_layers
        bwd = [bwd_ms] * num_layers
        mem = [mem_bytes] * num_layers
        fwd[-1] = fwd_ms * head_factor
        bwd[-1] = bwd_ms * head_factor
        mem[-1] = round(mem_bytes * head_factor)
        return cls(tuple(fwd), tuple(bwd), tuple(mem))

    # ------------------------------------------------------------------ stage sums

    def _check_range(self, layers: range) -> None:
        if not isinstance(layers, range) or layers.step != 1:
            raise PlanError(f"a stage is a range of consecutive layers with step 1, got {layers!r}")
        if not 0 <= layers.start <= layers.stop <= self.num_layers:
            raise PlanError(
                f"stage {layers!r} is outside the {self.num_layers} layers these costs describe "
                f"(valid layers are 0..{self.num_layers - 1})"
            )

    def fwd_stage_ms(self, layers: range) -> float:
        """A forward stage: the sum of its layers' forward times."""
        self._check_range(layers)
        return math.fsum(self.fwd_ms[layers.start : layers.stop])

    def bwd_stage_ms(self, layers: range) -> float:
        """A backward stage: recompute (forward) plus backward of each of its layers."""
        self._check_range(layers)
        return math.fsum(self.fwd_ms[layers.start : layers.stop]) + math.fsum(
            self.bwd_ms[layers.start : layers.stop]
        )

    def fused_stage_ms(self, layers: range) -> float:
        """The fused stage: forward then backward, no recompute; the same sum as a backward stage."""
        return self.bwd_stage_ms(layers)

    def stage_mem(self, layers: range) -> int:
        """Device bytes a stage needs while it runs: the sum over its layers."""
        self._check_range(layers)
        return sum(self.mem_bytes[layers.start : layers.stop])

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "fwd_ms": list(self.fwd_ms),
            "bwd_ms": list(self.bwd_ms),
            "mem_bytes": list(self.mem_bytes),
        }
        if self.names is not None:
            d["names"] = list(self.names)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerCosts:
        if not isinstance(d, Mapping):
            raise PlanError(
                f"layer costs must be a JSON object with keys {list(_KEYS)}, got {type(d).__name__}"
            )
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise PlanError(f"unknown key(s) {unknown} in layer costs; the accepted keys are {list(_KEYS)}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise PlanError(f"layer costs lack {missing}; give {list(_REQUIRED)} (and optionally 'names')")
        return cls(d["fwd_ms"], d["bwd_ms"], d["mem_bytes"], d.get("names"))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the costs as JSON, atomically (a temp file renamed over ``path``)."""
        target = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(target))
        fd, tmp = tempfile.mkstemp(prefix=".costs-", suffix=".json", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(self.to_dict(), fh, indent=1)
                fh.write("\n")
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> LayerCosts:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"{os.fspath(path)} is not valid JSON ({exc}); expected a layer costs file"
            ) from exc
        return cls.from_dict(data)
