"""The NF4 code book and the tables made from it on each device: the format
(`roundpipe.model.nf4`) and its CUDA kernel (`roundpipe.model.nf4_triton`) both read them, and
neither may import the other's module for them (the format dispatches to the kernel)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# QLoRA's NormalFloat4 code book (arXiv 2305.14314, appendix E): quantiles of N(0, 1) scaled to
# [-1, 1], with an exact zero; 7 negative and 8 positive values.
NF4_CODES: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_table(
    name: str, device: torch.device, build: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The table ``name``, ``build(codes)`` from the fp32 code book on the CPU, on ``device``: made
    once per device, since a host-to-device copy in every layer call would stall a host that runs
    ahead of the GPU."""
    table = _TABLES.get((name, device))
    if table is None:
        table = build(torch.tensor(NF4_CODES, dtype=torch.float32)).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # complete before another stream reads it
        _TABLES[(name, device)] = table
    return table
