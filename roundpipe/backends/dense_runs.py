"""The dense copies of a stage run's 4-bit weights, made once for all its microbatches.

Why a store of its own: a run's transient weights (the runtime's ``transient``) live from its
upload to its gradient download, but its dense copies (`roundpipe.model.dense_weights`) are
needed only from its first compute to its last, and only on the lane that computes. A forward or
fused run's first microbatch may compute before the run before it on the device has ended (the
engine fills the lane while that run waits for an input: `python bench/run_overlap.py`), so a run
makes its copies at its first compute that finds no other run's on its device; the computes
before that dequantize inside their calls. One stage's copies are on a device at a time, which
is what the memory model counts (``LayerMemory.dense_bytes``): on a 70B base two 5-layer
stages' copies would be 17 GB.

This module must never upload, download or decide when anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from roundpipe.backends.host_data import RunKey
from roundpipe.model.dense_weights import QuantizedSublayer, dequantize_run, quantized_sublayers
from roundpipe.sched.task import Task

Params = dict[int, dict[str, torch.Tensor]]  # layer -> name -> tensor


class DenseRuns:
    """Per run, its transient weights with the dense copies added, while ``enabled``."""

    def __init__(self, layers: Sequence[nn.Module], dtype: torch.dtype) -> None:
        self.layers, self.dtype = layers, dtype
        self.enabled = False
        # Layers whose runs dequantize in each call while the others' hold dense copies: the plan's
        # memory table counts no copies for them (`roundpipe.planning.even_stages`: a fused stage).
        self.per_call: frozenset[int] = frozenset()
        self.runs: dict[RunKey, Params] = {}
        self._quantized: dict[int, tuple[QuantizedSublayer, ...]] = {}

    def holds_quantized(self) -> bool:
        """Whether any layer holds a 4-bit weight (a run would have something to make dense)."""
        return any(self._sublayers(layer) for layer in range(len(self.layers)))

    def _sublayers(self, layer: int) -> tuple[QuantizedSublayer, ...]:
        sublayers = self._quantized.get(layer)
        if sublayers is None:
            sublayers = self._quantized[layer] = quantized_sublayers(self.layers[layer])
        return sublayers

    def params(self, run: RunKey, transient: dict[RunKey, Params]) -> Params:
        """``run``'s weights for a compute: its transient copy, and where it dequantizes once,
        the dense copies of its 4-bit weights too (made by its first compute that finds no other
        run's copies on its device)."""
        params = transient.get(run, {})
        if not self.enabled:
            return params
        held = self.runs.get(run)
        if held is not None:
            return held
        # A snapshot: other devices' lanes add and drop their runs meanwhile (CPU workers' threads).
        if any(other.device == run.device for other in tuple(self.runs)):
            return params  # the run before still holds its copies: this compute dequantizes in its calls
        held = dict(params)
        for layer, named in params.items():
            if layer not in self.per_call and (sublayers := self._sublayers(layer)):
                held[layer] = named | dequantize_run(sublayers, named, self.dtype)
        # Kept also where every layer is per call (a fused stage, `per_call`): the next run on the
        # device makes its copies only once this one's last compute is done, as the memory model
        # counts one run's copies beside a stage, never beside a fused stage's activations.
        self.runs[run] = held
        return held

    def per_call_layers(self) -> list[int]:
        """The layers holding 4-bit weights that dequantize in each call though runs hold copies."""
        if not self.enabled:
            return []
        return sorted(layer for layer in self.per_call if layer < len(self.layers) and self._sublayers(layer))

    def drop(self, task: Task) -> None:
        """After a run's last compute (``task``, a compute task) its dense copies go. They were
        made and read on the compute lane only, so on CUDA the allocator hands their memory to
        later work on that stream, in order: no hold until the task has run, which would put two
        runs' copies on the device."""
        if task.part == task.num_parts - 1:
            self.runs.pop(RunKey(task.device, task.iteration, task.round, task.slot), None)
