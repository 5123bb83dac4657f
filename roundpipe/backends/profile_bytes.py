"""The bytes a profiled layer call leaves for its backward, hands on, or makes in passing.

Why apart from `roundpipe.backends.profile`: these read the allocator's and autograd's view of one
measured call (storages still allocated, gradients computed ahead in a forward, dense copies a
4-bit weight makes inside its call) and turn them into `LayerMeasurement` figures; the profile
decides what to run and when. Nothing here runs a layer.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from roundpipe.backends.storages import collect_storages, storage_bytes

ShapedRefs = dict[torch.Size, list[weakref.ref[torch.UntypedStorage]]]  # parameter shape -> saved storages


def allocated_for_backward(
    out: Any, inputs: dict[int, int], saved: dict[int, int], grad_fwd: dict[str, float]
) -> int:
    """The allocator's view of what the forward with grad left for the backward: bytes still
    allocated after it, less its new outputs that autograd did not save, plus saved inputs."""
    grad_outputs: dict[int, int] = {}
    collect_storages(out, grad_outputs)
    unsaved_new = sum(b for k, b in grad_outputs.items() if k not in inputs and k not in saved)
    saved_inputs = sum(b for k, b in saved.items() if k in inputs)
    return int(grad_fwd["after"] - grad_fwd["before"]) - unsaved_new + saved_inputs


def gradients_saved_ahead(params: dict[str, torch.Tensor], param_shaped: ShapedRefs) -> int:
    """Bytes of parameter gradients that are saved storages: computed ahead in the forward (a
    chunked loss), handed on by the backward rather than allocated."""
    ahead = [s for refs in param_shaped.values() for ref in refs if (s := ref()) is not None]
    return sum(
        storage_bytes(p.grad)
        for p in params.values()
        if p.grad is not None and any(p.grad.untyped_storage() is s for s in ahead)
    )


def dequantized_bytes(layer: nn.Module, dtype: torch.dtype | None) -> int:
    """The largest dense weight a quantized sublayer makes during its call and its backward
    (`roundpipe.model.quant.NF4Linear`): it lives only inside the call, so it is working set, not
    parameters, and on a CPU, where no allocator reports a peak, it is the working set's floor."""
    sizes = [0]
    for module in layer.modules():
        measure: Any = getattr(module, "dequantized_bytes", None)
        if callable(measure):
            sizes.append(int(measure(dtype or getattr(module, "weight_dtype", torch.float32))))
    return max(sizes)
