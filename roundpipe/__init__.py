"""roundpipe: fine-tune large models on a few small GPUs.

Everything large lives in host memory; GPUs are stateless workers that take the next stage in
turn; an asyncio engine overlaps every transfer with compute; the optimizer runs on the CPU one
step behind. This package exports the public API only; see docs/api.md.
"""

from roundpipe.config import RunConfig
from roundpipe.errors import (
    ConfigError,
    DeviceOutOfMemoryError,
    InputError,
    ModelError,
    PipeClosedError,
    PlanError,
    RoundPipeError,
    ScheduleError,
    StageError,
    TaskFailedError,
)
from roundpipe.pipe import RoundPipe

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeviceOutOfMemoryError",
    "InputError",
    "ModelError",
    "PipeClosedError",
    "PlanError",
    "RoundPipe",
    "RoundPipeError",
    "RunConfig",
    "ScheduleError",
    "StageError",
    "TaskFailedError",
    "__version__",
]
