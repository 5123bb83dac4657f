"""Losses of submitted iterations that were not read yet: `PendingLoss` and the `LossLedger`.

A ``forward_backward(..., wait=False)`` returns before its loss is in; this module keeps those
iterations in submission order, reads their losses oldest first (so a finished iteration's
losses can be freed once a later one is read), bounds how many may be outstanding, and marks
the ones that an earlier failure dropped. It must never submit tasks nor recover from a failure
itself: the facade (`roundpipe.pipe`) owns both and is called back for them.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from roundpipe.errors import ScheduleError, TaskFailedError, name_earlier_iteration

if TYPE_CHECKING:
    from roundpipe.backends.runtime import Runtime
    from roundpipe.loop_thread import LoopRunner
    from roundpipe.sched.engine import Engine

LOSSES_IN_FLIGHT = 2
"""Iterations whose losses may be outstanding (`RoundPipe.forward_backward` with ``wait=False``):
enough for a loop that reads each loss one iteration late to keep the devices fed, few enough
that inputs and saved activations do not pile up on the host."""


class LossOwner(Protocol):
    """What a `PendingLoss` needs of the pipe that submitted it."""

    _runner: LoopRunner

    def _check_open(self) -> None: ...

    def _collect(self, pending: PendingLoss) -> Coroutine[Any, Any, float]: ...

    def _recover(self, error: BaseException) -> None: ...

    async def _housekeeping(self) -> None: ...


class PendingLoss:
    """The loss of an iteration submitted by ``forward_backward(..., wait=False)``.

    ``result()`` blocks until the iteration's losses are in (not its whole backward: as with
    ``wait=True``, deep stages may still run) and returns the mean microbatch loss; it raises what
    the iteration raised, and an iteration dropped because an earlier one failed raises
    `TaskFailedError` saying so. Losses are read in submission order: waiting for one reads every
    earlier one first."""

    __slots__ = ("_dropped", "_loss_keys", "_pipe", "_value", "_weights", "iteration")

    def __init__(self, pipe: LossOwner, iteration: int, loss_keys: list[Any], weights: list[float]) -> None:
        self._pipe = pipe
        self.iteration = iteration
        self._loss_keys = loss_keys
        self._weights = weights
        self._value: float | None = None
        self._dropped: BaseException | None = None  # what result() raises

    def done(self) -> bool:
        """Whether ``result()`` would return (or raise) without waiting."""
        return self._value is not None or self._dropped is not None

    def result(self) -> float:
        if self._value is not None:
            return self._value
        self._pipe._check_open()
        return self._pipe._runner.run(self._pipe._collect(self))

    async def aresult(self) -> float:
        if self._value is not None:
            return self._value
        self._pipe._check_open()
        return await self._pipe._runner.arun(self._pipe._collect(self))

    def __repr__(self) -> str:
        state = (
            f"loss={self._value:.6g}"
            if self._value is not None
            else "dropped"
            if self._dropped
            else "pending"
        )
        return f"PendingLoss(iteration={self.iteration}, {state})"


def _dropped_error(iteration: int, cause: BaseException) -> TaskFailedError:
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    error = TaskFailedError(
        f"iteration {iteration} was dropped before its loss was in: an earlier iteration failed ({first}); "
        "its gradients were not applied, and the next forward_backward starts cleanly",
        iteration=iteration,
    )
    error.__cause__ = cause
    return error


class LossLedger:
    """The submitted iterations whose losses were not read yet, oldest first.

    The pipe that submitted an iteration (its `LossOwner`) recovers from its failure before the
    error is raised (dropping the iterations submitted after it, through `drop_all`), and tidies
    up after each loss is read. The ledger holds no reference to the pipe, so that dropping an
    unclosed pipe still finalizes it at once rather than at the next cycle collection.
    """

    def __init__(self, engine: Engine, runtime: Runtime) -> None:
        self._engine = engine
        self._runtime = runtime
        self._waiting: dict[int, PendingLoss] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, pending: PendingLoss) -> None:
        self._waiting[pending.iteration] = pending

    async def make_room(self, caller: int) -> None:
        """Bounded look-ahead: the oldest iteration still waiting for its losses goes first.
        ``caller``: the iteration about to be submitted, which an error then names."""
        while len(self._waiting) >= LOSSES_IN_FLIGHT:
            await self.collect(next(iter(self._waiting.values())), caller=caller)

    async def collect(self, pending: PendingLoss, caller: int | None = None) -> float:
        """Wait for ``pending``'s losses (and, first, those of every earlier iteration still
        waiting: a finished iteration's losses are freed once a later one is collected).
        ``caller``: the iteration of the call that waits, if not ``pending``'s (a submission
        waiting for room), which an error then names."""
        while pending._value is None:
            if pending._dropped is not None:
                raise pending._dropped
            oldest = next(iter(self._waiting.values()))
            iteration = oldest.iteration
            try:
                await self._engine.wait(oldest._loss_keys)
            except (TaskFailedError, ScheduleError) as exc:
                oldest._dropped = exc  # its own failure (or an earlier iteration's, named below)
                del self._waiting[iteration]
                oldest._pipe._recover(exc)  # drops the iterations submitted after it
                name_earlier_iteration(exc, pending.iteration if caller is None else caller)
                raise
            losses = self._runtime.iterations[iteration].losses
            weights = oldest._weights
            oldest._value = float(sum(weights[mb] * float(losses[mb]) for mb in range(len(weights))))
            del self._waiting[iteration]
            await oldest._pipe._housekeeping()
        return pending._value

    async def collect_all(self) -> None:
        """Collect every iteration still waiting for its losses (before their tasks are freed)."""
        while self._waiting:
            await self.collect(next(reversed(self._waiting.values())))

    def drop_all(self, error: BaseException) -> None:
        """Mark every waiting iteration dropped by ``error`` (they were submitted after it)."""
        for pending in self._waiting.values():
            pending._dropped = _dropped_error(pending.iteration, error)
        self._waiting.clear()
