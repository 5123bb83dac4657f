"""The engine's upkeep: refusing a malformed batch, dropping work after a failure, forgetting
old tasks, and the statistics snapshot.

Why apart from `roundpipe.sched.engine`: none of this is on the path a task takes from submission
to completion; it keeps the engine's index and counters right when something goes wrong or a run
goes on for long. `EngineUpkeep` is a base of `Engine` and reads the engine's own fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roundpipe.errors import ScheduleError
from roundpipe.sched.diagnostics import cycle_message, find_cycle
from roundpipe.sched.keys import Age
from roundpipe.sched.kinds import TaskState
from roundpipe.sched.task import Key, Task

if TYPE_CHECKING:
    from roundpipe.sched.backend import Backend

_DONE = TaskState.DONE
_CANCELLED = TaskState.CANCELLED


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine's state (counts only; no internals)."""

    submitted: int
    waiting: int
    ready: int
    running: int
    done: int
    failed: int
    now_ms: float


class EngineUpkeep:
    """What `Engine` does besides running tasks; see the module docstring."""

    backend: Backend
    _tasks: dict[Key, Task]
    _missing: dict[Key, list[Task]]
    _resources: dict[str, Any]
    _failed: list[Task]
    _forgotten: Callable[[Key], bool] | None
    _finished_by_age: dict[Age, list[Key]]
    _finished_ageless: dict[Key, None]
    _seq: int
    _pending: int
    _ready: int
    _running: int
    _done: int

    def _forget_partial(self, new: list[Task], duplicate: Task) -> None:
        """Undo the key registrations of a batch refused for a duplicate key (up to ``duplicate``)."""
        for task in new:
            if task is duplicate:
                return
            self._tasks.pop(task.key, None)
            task.seq = -1

    def _check_acyclic(self, new: list[Task]) -> None:
        cycle = find_cycle(new)
        if cycle is None:
            return
        # Leave the engine usable: forget the whole malformed batch.
        for task in new:
            self._tasks.pop(task.key, None)
            task.state = _CANCELLED
        self._pending -= len(new)
        for task in self._tasks.values():
            task.dependents = [d for d in task.dependents if d.state != _CANCELLED]
            task.issue_dependents = [d for d in task.issue_dependents if d.state != _CANCELLED]
        for key in list(self._missing):
            self._missing[key] = [d for d in self._missing[key] if d.state != _CANCELLED]
            if not self._missing[key]:
                del self._missing[key]
        raise ScheduleError(cycle_message(cycle))

    # ------------------------------------------------------------------ housekeeping

    def cancel_pending(self) -> int:
        """Drop every task that has not finished (after a failure); returns how many were dropped.

        Must not be called while tasks are running: wait() has drained them when it raised.
        """
        if self._running:
            raise ScheduleError(f"cancel_pending() with {self._running} task(s) still running")
        dropped = 0
        for key, task in list(self._tasks.items()):
            if task.state != _DONE:
                task.state = _CANCELLED
                task.dependents = []
                del self._tasks[key]
                dropped += 1
        for res in self._resources.values():
            res.heap.clear()
        self._missing.clear()
        self._failed.clear()
        self._pending = 0
        self._ready = 0
        return dropped

    def forget(self, older: Callable[[Key], bool]) -> None:
        """Drop finished tasks whose key ``older(key)`` calls old from the key index, to bound
        memory in long runs. From then on a dependency on a key that is not known and that
        ``older`` calls old counts as done: it was, and was forgotten. ``older`` must only grow
        (each call's predicate accepts every key the previous one did) and must judge a key by
        its age alone (`roundpipe.sched.keys.key_age`: its iteration or its step).

        Why by age: the engine keeps ten iterations of finished tasks (tens of thousands on a
        48-layer model), and asking about each of them at every iteration held the loop thread,
        and the interpreter lock the lanes issue with, for 60 ms an iteration on a 2-core host.
        Finished keys are filed by age as they finish, so one question per age suffices; keys
        without an age (hand-written tuples) are asked one by one."""
        self._forgotten = older
        tasks = self._tasks
        for age in [age for age, keys in self._finished_by_age.items() if older(keys[0])]:
            for key in self._finished_by_age.pop(age):
                task = tasks.get(key)
                if task is not None and task.state == _DONE:
                    del tasks[key]
        kept: dict[Key, None] = {}
        for key in self._finished_ageless:
            task = tasks.get(key)
            if task is None or task.state != _DONE:
                continue  # dropped, or submitted again: filed again when it finishes
            if older(key):
                del tasks[key]
            else:
                kept[key] = None
        self._finished_ageless = kept

    def is_done(self, key: Key) -> bool:
        task = self._tasks.get(key)
        return task is not None and task.state == _DONE

    def statistics(self) -> EngineStatistics:
        waiting = self._pending - self._ready - self._running
        return EngineStatistics(
            submitted=self._seq,
            waiting=waiting,
            ready=self._ready,
            running=self._running,
            done=self._done,
            failed=len(self._failed),
            now_ms=self.backend.now(),
        )
