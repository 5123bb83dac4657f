"""roundpipe: fine-tune large models on a few small GPUs.

Everything large lives in host memory; GPUs are stateless workers that take the next stage in
turn; an asyncio engine overlaps every transfer with compute; the optimizer runs on the CPU one
step behind. This package exports the public API only; see docs/api.md.

`RoundPipe` and `RunConfig` are loaded on first access (PEP 562): the facade pulls in torch and
the configuration pydantic, and importing this package must do neither, because every submodule
import runs it first. So the planner stays standard-library only, and the scheduler, the fake
backend and the ``roundpipe plan | simulate | trace`` commands run where torch is absent
(tests/test_layering.py checks both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from roundpipe.errors import (
    CheckpointError,
    ConfigError,
    DeviceOutOfMemoryError,
    HostMemoryError,
    InputError,
    ModelError,
    PipeClosedError,
    PlanError,
    RoundPipeError,
    ScheduleError,
    StageError,
    TaskFailedError,
    UsageError,
)
from roundpipe.quiet import install_filters as _install_filters

_install_filters()  # other libraries' known, unactionable messages (roundpipe/quiet.py)

if TYPE_CHECKING:
    from roundpipe.config import RunConfig
    from roundpipe.pipe import PendingLoss, RoundPipe

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeviceOutOfMemoryError",
    "HostMemoryError",
    "InputError",
    "ModelError",
    "PendingLoss",
    "PipeClosedError",
    "PlanError",
    "RoundPipe",
    "RoundPipeError",
    "RunConfig",
    "ScheduleError",
    "StageError",
    "TaskFailedError",
    "UsageError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    value: Any
    if name == "RoundPipe":
        from roundpipe.pipe import RoundPipe as value
    elif name == "PendingLoss":
        from roundpipe.pipe import PendingLoss as value
    elif name == "RunConfig":
        from roundpipe.config import RunConfig as value
    else:
        raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value
