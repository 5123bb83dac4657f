"""Whether an error is the device running out of memory, in whatever form it reached us.

Why a module of its own: the allocator raises ``torch.OutOfMemoryError``, but code between it and
roundpipe may re-raise it as something else: inductor's autotuning, compiling a graph variant,
raises a plain ``RuntimeError`` carrying the allocator's message. The profiler, the runtime and
the stage math all decide on it (an out-of-memory gets the prediction and what was held, anything
else names a broken layer), and the stage math sits below the holdings that format the former,
so the test lives apart from both. It must only read the error chain, never touch the device.
"""

from __future__ import annotations

import torch


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the allocator running out, or an error raised on its account: inductor's
    autotuning re-raises a CUDA out-of-memory as a plain error that carries only its message."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError) or "CUDA out of memory" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
