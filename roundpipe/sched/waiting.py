"""How a caller waits on the engine: the half of `Engine` that runs while someone awaits.

Why apart: submitting and completing tasks (`roundpipe.sched.engine`) is the hot path; waiting
decides *how* time passes. On a virtual backend it advances the clock in stretches of
`YIELD_EVERY` events and yields to the loop between them; on a real backend it sleeps on a
future that the completion callback resolves, with an optional watchdog. Either way it stops
when the awaited tasks are done, and raises when a task failed (once the running work has
drained) or when nothing can ever run again. It reads the engine's counters and never changes a
task: only `Engine._task_done` does.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from roundpipe.errors import ScheduleError, TaskFailedError
from roundpipe.sched.backend import Backend
from roundpipe.sched.diagnostics import failure_error, stall_message, watchdog_message
from roundpipe.sched.kinds import TaskState
from roundpipe.sched.task import Key, Task


class Engine(Protocol):
    """What waiting reads of `roundpipe.sched.engine.Engine` (named here, not imported, so the
    engine's module can import this one)."""

    backend: Backend
    stall_timeout_s: float | None
    _tasks: dict[Key, Task]
    _failed: list[Task]
    _pending: int
    _ready: int
    _running: int
    _wakeup: asyncio.Future[None] | None


YIELD_EVERY = 4096  # virtual events between yields to the loop, so other coroutines keep ticking
# What one stretch of virtual events ended with (see `_advance_virtual`).
_STUCK = "stuck"  # nothing was running
_PROGRESS = "progress"  # the awaited tasks are done, or a task failed
_BUDGET_SPENT = "budget spent"  # YIELD_EVERY events ran: yield to the loop, then go on
_DONE = TaskState.DONE


async def wait_until_done(engine: Engine, targets: list[Task] | None) -> None:
    """Run ``engine`` until ``targets`` (None: every submitted task) are done; see `Engine.wait`."""
    index = 0
    virtual = engine.backend.virtual
    while True:
        if engine._failed and engine._running == 0 and engine._ready == 0:
            _raise_failure(engine)
        if engine._failed:
            pass  # keep running unrelated work until the failure is isolated
        elif targets is None:
            if engine._pending == 0:
                return
        else:
            while index < len(targets) and targets[index].state is _DONE:
                index += 1
            if index == len(targets):
                return
        if virtual:
            outcome = _advance_virtual(engine, targets[index] if targets is not None else None)
            if outcome is _STUCK:
                _raise_stuck(engine, targets[index:] if targets is not None else None)
            if outcome is _BUDGET_SPENT:
                await asyncio.sleep(0)  # let other coroutines on the loop tick
        else:
            if engine._running == 0:
                _raise_stuck(engine, targets[index:] if targets is not None else None)
            await _sleep_until_progress(engine)


def _advance_virtual(engine: Engine, target: Task | None) -> str:
    """Complete up to `YIELD_EVERY` virtual events; stop early when ``target`` (None: every
    submitted task) is done or a task failed, so the caller can re-check its exit conditions."""
    backend = engine.backend
    advance = backend.advance
    for _ in range(YIELD_EVERY):
        if not advance():
            return _STUCK
        if engine._failed:
            return _PROGRESS
        if target is None:
            if engine._pending == 0:
                return _PROGRESS
        elif target.state is _DONE:
            _finish_instant(backend)
            return _PROGRESS
    return _BUDGET_SPENT


def _finish_instant(backend: Backend) -> None:
    """Complete every other event of the current virtual instant before the waiter acts: what
    the waiter submits then finds the instant's completions all in, as a real caller, woken some
    time after its task ended, would. Without it, a batch submitted in the middle of an instant
    could start on a lane a higher-priority task was about to be released onto, and when a loop
    submits would depend on the order of equal end times (`roundpipe.planning.replay` models the
    loop's submission on this rule)."""
    now = backend.now()
    while backend.next_time() == now and backend.advance():
        pass


async def _sleep_until_progress(engine: Engine) -> None:
    """Sleep until the completion callback resolves the engine's wakeup future (or the watchdog,
    when ``stall_timeout_s`` is set, finds no task finished in time)."""
    loop = asyncio.get_running_loop()
    wakeup = engine._wakeup = loop.create_future()
    try:
        if engine.stall_timeout_s is None:
            await wakeup
        else:
            try:
                await asyncio.wait_for(asyncio.shield(wakeup), engine.stall_timeout_s)
            except asyncio.TimeoutError:
                message = watchdog_message(engine._tasks.values(), engine.stall_timeout_s)
                raise ScheduleError(message) from None
    finally:
        engine._wakeup = None


def _raise_stuck(engine: Engine, targets: list[Task] | None) -> None:
    """Nothing runs: report the failure that caused it, else the stall."""
    if engine._failed:
        _raise_failure(engine)
    awaited = len(targets) if targets is not None else None
    raise ScheduleError(stall_message(engine._tasks, awaited, engine._pending))


def _raise_failure(engine: Engine) -> None:
    task = engine._failed[0]
    if isinstance(task.error, TaskFailedError):
        if task.error.iteration is None and task.iteration >= 0:
            task.error.iteration = task.iteration
        raise task.error
    raise failure_error(task) from task.error
