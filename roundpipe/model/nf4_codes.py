"""The NF4 code book alone: the format (`roundpipe.model.nf4`) and its CUDA kernel
(`roundpipe.model.nf4_triton`) both read it, and neither may import the other's module for it
(the format dispatches to the kernel)."""

from __future__ import annotations

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
