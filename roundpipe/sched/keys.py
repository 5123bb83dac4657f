"""Task keys: the name of every task, one small tuple type per kind.

Why tuples with names: a key is looked up in the engine's index and in dependency lists 10^5
times per run, so it must hash and compare as fast as a plain tuple; and it is written to JSON
as a list (kind first), so traces stay readable and traces of older versions load unchanged. The
named fields say what each position means, and each key says whether it belongs to an iteration
(device tasks, G-copies: ``key.iteration``) or to an optimizer step (step, P-copy, grad norm:
``key.step``), which is what retention policies read. Keys compare equal to the plain tuples
they spell, so a hand-written ``("compute", 0, 1, 2)`` still finds ``ComputeKey(0, 1, 2)``.

This module must never hold anything but the key types and their (de)serialisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from roundpipe.sched.kinds import TaskKind

Key = tuple[Any, ...]
"""Any task's identity: one of the key types below, or any hashable tuple (tests, tools)."""

# Module globals, not enum attributes: reading an enum member off its class costs ~20x more,
# and a key is built per task.
_new = tuple.__new__
_PARAM_UP = TaskKind.PARAM_UP
_ACT_UP = TaskKind.ACT_UP
_GRAD_UP = TaskKind.GRAD_UP
_RECOMPUTE = TaskKind.RECOMPUTE
_COMPUTE = TaskKind.COMPUTE
_ACT_DOWN = TaskKind.ACT_DOWN
_GRAD_DOWN = TaskKind.GRAD_DOWN
_G_COPY = TaskKind.G_COPY
_STEP = TaskKind.STEP
_P_COPY = TaskKind.P_COPY
_GRAD_NORM = TaskKind.GRAD_NORM


class _ParamUpFields(NamedTuple):
    kind: TaskKind
    iteration: int
    round: int
    slot: int
    layer: int
    part: int


class _MicrobatchFields(NamedTuple):
    kind: TaskKind
    iteration: int
    slot: int
    microbatch: int


class _GradDownFields(NamedTuple):
    kind: TaskKind
    iteration: int
    round: int
    slot: int


class _UnitOfIterationFields(NamedTuple):
    kind: TaskKind
    iteration: int
    unit: int


class _UnitOfStepFields(NamedTuple):
    kind: TaskKind
    step: int
    unit: int


class _GradNormFields(NamedTuple):
    kind: TaskKind
    step: int


class ParamUpKey(_ParamUpFields):
    """Upload of one layer (``part`` of it when chunked) for one stage run of an iteration."""

    __slots__ = ()

    def __new__(cls, iteration: int, round: int, slot: int, layer: int, part: int) -> ParamUpKey:
        return _new(cls, (_PARAM_UP, iteration, round, slot, layer, part))


class ActUpKey(_MicrobatchFields):
    """A stage's input activation of one microbatch, host to device."""

    __slots__ = ()

    def __new__(cls, iteration: int, slot: int, microbatch: int) -> ActUpKey:
        return _new(cls, (_ACT_UP, iteration, slot, microbatch))


class GradUpKey(_MicrobatchFields):
    """A backward stage's incoming gradient of one microbatch, host to device."""

    __slots__ = ()

    def __new__(cls, iteration: int, slot: int, microbatch: int) -> GradUpKey:
        return _new(cls, (_GRAD_UP, iteration, slot, microbatch))


class RecomputeKey(_MicrobatchFields):
    """A backward stage's recompute of one microbatch: its forward again, keeping the graph."""

    __slots__ = ()

    def __new__(cls, iteration: int, slot: int, microbatch: int) -> RecomputeKey:
        return _new(cls, (_RECOMPUTE, iteration, slot, microbatch))


class ComputeKey(_MicrobatchFields):
    """One stage over one microbatch (of a backward stage: its backward, after the recompute)."""

    __slots__ = ()

    def __new__(cls, iteration: int, slot: int, microbatch: int) -> ComputeKey:
        return _new(cls, (_COMPUTE, iteration, slot, microbatch))


class ActDownKey(_MicrobatchFields):
    """A stage's output (activation or input gradient) of one microbatch, device to host."""

    __slots__ = ()

    def __new__(cls, iteration: int, slot: int, microbatch: int) -> ActDownKey:
        return _new(cls, (_ACT_DOWN, iteration, slot, microbatch))


class GradDownKey(_GradDownFields):
    """The gradients of one fused or backward stage run, device to host."""

    __slots__ = ()

    def __new__(cls, iteration: int, round: int, slot: int) -> GradDownKey:
        return _new(cls, (_GRAD_DOWN, iteration, round, slot))


class GCopyKey(_UnitOfIterationFields):
    """One unit's gradients of an iteration, added into the optimizer's fp32 gradients."""

    __slots__ = ()

    def __new__(cls, iteration: int, unit: int) -> GCopyKey:
        return _new(cls, (_G_COPY, iteration, unit))


class StepKey(_UnitOfStepFields):
    """One unit's optimizer step."""

    __slots__ = ()

    def __new__(cls, step: int, unit: int) -> StepKey:
        return _new(cls, (_STEP, step, unit))


class PCopyKey(_UnitOfStepFields):
    """One unit's weights after optimizer step ``step``, written into the compute copy."""

    __slots__ = ()

    def __new__(cls, step: int, unit: int) -> PCopyKey:
        return _new(cls, (_P_COPY, step, unit))


class GradNormKey(_GradNormFields):
    """The global gradient-norm barrier before optimizer step ``step``."""

    __slots__ = ()

    def __new__(cls, step: int) -> GradNormKey:
        return _new(cls, (_GRAD_NORM, step))


IterationKey = (
    ParamUpKey | ActUpKey | GradUpKey | RecomputeKey | ComputeKey | ActDownKey | GradDownKey | GCopyKey
)
"""Keys of tasks that belong to one `forward_backward` call: they have ``.iteration``."""
StepScopedKey = StepKey | PCopyKey | GradNormKey
"""Keys of tasks that belong to one optimizer step: they have ``.step``."""
TaskKey = IterationKey | StepScopedKey

ITERATION_KEYS = (
    ParamUpKey,
    ActUpKey,
    GradUpKey,
    RecomputeKey,
    ComputeKey,
    ActDownKey,
    GradDownKey,
    GCopyKey,
)
STEP_KEYS = (StepKey, PCopyKey, GradNormKey)

Age = tuple[bool, int]
"""What a key's age is read from: (False, its iteration) or (True, its optimizer step)."""


def key_age(key: Key) -> Age | None:
    """The age of ``key`` (`Age`), which retention policies read; None for a key of no iteration
    or step (a hand-written tuple)."""
    if isinstance(key, ITERATION_KEYS):
        return (False, key.iteration)
    if isinstance(key, STEP_KEYS):
        return (True, key.step)
    return None


_KEY_TYPES: dict[str, type[tuple[Any, ...]]] = {
    TaskKind.PARAM_UP: ParamUpKey,
    TaskKind.ACT_UP: ActUpKey,
    TaskKind.GRAD_UP: GradUpKey,
    TaskKind.RECOMPUTE: RecomputeKey,
    TaskKind.COMPUTE: ComputeKey,
    TaskKind.ACT_DOWN: ActDownKey,
    TaskKind.GRAD_DOWN: GradDownKey,
    TaskKind.G_COPY: GCopyKey,
    TaskKind.STEP: StepKey,
    TaskKind.P_COPY: PCopyKey,
    TaskKind.GRAD_NORM: GradNormKey,
}


def key_from_json(value: Sequence[Any]) -> Key:
    """The key a JSON list spells: its named type when the kind and length match one (traces of
    every version), else a plain tuple (hand-made keys)."""
    if value and isinstance(value[0], str):
        key_type = _KEY_TYPES.get(value[0])
        if key_type is not None and len(value) == len(key_type._fields):  # type: ignore[attr-defined]
            return key_type(*value[1:])
    return tuple(value)
