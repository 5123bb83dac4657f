"""The CPU backend: N worker "devices" made of threads, doing real torch math.

Why it exists: CI has no GPU, yet the whole training path (transient copies, boundary
activations on the host, recompute, gradient downloads, the optimizer lane) must run and be
compared against plain PyTorch. Each device gets one thread per lane (compute, act_up, act_down,
param_up, grad_down) and the host one optimizer thread, so lanes overlap exactly as CUDA streams
would; the math itself is the shared `Runtime`, and the threads are `LaneThreadBackend`'s.

It must never decide ordering (the engine does) and never leave a thread running after
`close()`.
"""

from __future__ import annotations

from roundpipe.backends.threads import LaneThreadBackend


class CpuBackend(LaneThreadBackend):
    """Runs tasks on per-lane worker threads (started as each lane is first used, so the
    device count is the plan's, not the backend's); see the module docstring."""
