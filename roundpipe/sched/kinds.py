"""The words of the task graph: what a task does (`TaskKind`) and where it is (`TaskState`).

Why enums of strings: a kind or a state is compared in the engine's hot path and written to
every trace; as `StrEnum` members they compare and hash as their strings (so traces stay plain
JSON, and traces of older versions load unchanged) while the code spells each word once. The
stage kinds (`SlotKind`) are the plan's and are re-exported here for the scheduler's readers.
This module must never import anything above `roundpipe.plan`.
"""

from __future__ import annotations

from roundpipe.plan.kinds import SlotKind, StrEnum


class TaskKind(StrEnum):
    """What a task does; also the name of the device lane it runs on (optimizer kinds aside)."""

    PARAM_UP = "param_up"
    ACT_UP = "act_up"
    GRAD_UP = "grad_up"  # a backward stage's incoming gradient, on the act_up lane
    RECOMPUTE = "recompute"  # a backward stage's forward again, on the compute lane
    COMPUTE = "compute"
    ACT_DOWN = "act_down"
    GRAD_DOWN = "grad_down"
    G_COPY = "g_copy"
    GRAD_NORM = "grad_norm"
    STEP = "step"
    P_COPY = "p_copy"


class TaskState(StrEnum):
    """Where a task is in its life: NEW (built) -> WAITING (submitted, dependencies unmet) ->
    READY (on its resource's heap) -> RUNNING (started on the backend) -> [ISSUED (its device
    work is queued on the device, with backends that issue ahead)] -> DONE or FAILED; CANCELLED
    when a dependency failed, the batch was refused, or pending work was dropped."""

    NEW = "new"
    WAITING = "waiting"
    READY = "ready"
    RUNNING = "running"
    ISSUED = "issued"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


__all__ = ["SlotKind", "TaskKind", "TaskState"]
