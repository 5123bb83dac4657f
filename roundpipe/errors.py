"""Every error roundpipe raises on purpose.

A user who catches ``roundpipe.RoundPipeError`` catches all of them. Each class also derives from
the builtin a PyTorch user would expect (``ValueError`` for bad input, ``RuntimeError`` for a
failure while running), so existing ``except ValueError`` code keeps working. Messages name the
layer, stage, device and task involved and say what to change; this module only defines the
types, it never formats tensors or imports torch.
"""

from __future__ import annotations


class RoundPipeError(Exception):
    """Base class of every roundpipe error."""


class ConfigError(RoundPipeError, ValueError):
    """A configuration value is invalid (message names the field and the accepted values)."""


class PlanError(RoundPipeError, ValueError):
    """Layer costs are invalid or the layers cannot be split into stages that fit."""


class ModelError(RoundPipeError, ValueError):
    """The model cannot be turned into a layer sequence."""


class HostMemoryError(RoundPipeError, MemoryError):
    """The host lacks memory a run must hold (the model's host copies, or the layer inputs one round
    saves), found before it is allocated; says how much, where from, and what to change."""


class CheckpointError(RoundPipeError, ValueError):
    """A checkpoint is missing, incomplete, damaged, from another model, or cannot be written there."""


class DataError(RoundPipeError, ValueError):
    """A training data file cannot be read or a record of it cannot become an example."""


class InputError(RoundPipeError, ValueError):
    """Inputs or targets cannot be split into the requested microbatches."""


class ScheduleError(RoundPipeError, RuntimeError):
    """The task graph is malformed: a dependency cycle, a duplicate key, or a task that can never run."""


class TaskFailedError(RoundPipeError, RuntimeError):
    """A task raised while running. ``task_description`` describes it, ``iteration`` is the
    `forward_backward` call it belongs to (None for an optimizer task); ``__cause__`` is the
    original exception."""

    def __init__(self, message: str, task_description: str = "", iteration: int | None = None) -> None:
        super().__init__(message)
        self.task_description = task_description
        self.iteration = iteration


class StageError(TaskFailedError):
    """A layer raised inside a stage; the message names layer, stage, device and microbatch."""


class DeviceOutOfMemoryError(StageError):
    """A stage did not fit on its device; the message says what to change."""


class UsageError(RoundPipeError, RuntimeError):
    """The API was called in an order it does not support (e.g. `step()` with no new gradients)."""


class PipeClosedError(RoundPipeError, RuntimeError):
    """The pipe was closed (explicitly or after a fatal error) and can no longer run work."""


def name_earlier_iteration(error: BaseException, current: int) -> None:
    """An earlier iteration's error (its backward ran on after its call returned) raised by the
    call of iteration ``current``: say so first, keeping the error's type."""
    earlier = getattr(error, "iteration", None)
    if isinstance(earlier, int) and earlier < current and error.args:
        where = f"iteration {earlier} (an earlier forward_backward call, still running when it returned)"
        error.args = (f"{where} failed; this call's iteration {current} was dropped too: {error.args[0]}",)
