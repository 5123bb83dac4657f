"""What a long run keeps, for how long, and why: the retention policy of `RoundPipe`.

Why a module of its own: a run of a million iterations must use the memory of a run of a few.
Three things grow with every iteration and each is let go at its own horizon:

- an iteration's inputs, targets and boundary activations (the runtime's `IterationData`) are
  kept until every task of that iteration is done, then freed at once;
- the trace keeps the last ``trace_iterations`` iterations (and the optimizer tasks of as many
  steps), which is what `RoundPipe.trace()` promises;
- the engine's index of finished tasks keeps a few iterations and steps more than the trace,
  because tasks of the next iterations still name them as dependencies. A dependency on a
  forgotten key counts as done (it was); `forget_horizon` is the one place that says which keys
  are old enough.

It must never free anything a task still in flight may read, and never decide ordering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from roundpipe.sched.keys import key_age
from roundpipe.sched.task import Key
from roundpipe.sched.trace import Trace

if TYPE_CHECKING:
    from roundpipe.backends.runtime import Runtime
    from roundpipe.sched.engine import Engine

# How far behind the trace's window the engine still indexes finished tasks. A margin, not a
# bound anything depends on exactly: forgetting only saves memory, so erring long costs little.
ITERATION_MARGIN = 2
STEP_MARGIN = 3


def forget_horizon(oldest_iteration: int, next_step: int) -> Callable[[Key], bool]:
    """Which finished task keys the engine may forget, given the oldest iteration the trace
    keeps and the number of steps requested so far. A key belongs to an iteration (device
    tasks, G-copies) or to a step (optimizer tasks), and is old by its age alone (`key_age`),
    as `Engine.forget` requires."""
    iteration_horizon = oldest_iteration - ITERATION_MARGIN
    step_horizon = next_step - STEP_MARGIN

    def is_old(key: Key) -> bool:
        age = key_age(key)
        if age is None:
            return False
        of_step, number = age
        return number < (step_horizon if of_step else iteration_horizon)

    return is_old


def trim_trace(trace: Trace, oldest_iteration: int, oldest_step: int) -> None:
    """Drop trace records of iterations before ``oldest_iteration`` and optimizer records
    (iteration < 0) of steps before ``oldest_step``."""
    records = trace.records
    if records and records[0].iteration < oldest_iteration:
        trace.records = [
            t
            for t in records
            if t.iteration >= oldest_iteration or (t.iteration < 0 and t.step >= oldest_step)
        ]


class Retention:
    """Tracks the iterations still in flight and lets go of what the policy above says."""

    def __init__(self, trace_iterations: int) -> None:
        self.trace_iterations = trace_iterations
        self._unfinished: list[tuple[int, list[Any]]] = []

    def track(self, iteration: int, done_keys: list[Any]) -> None:
        """``iteration`` is finished once every key of ``done_keys`` is done."""
        self._unfinished.append((iteration, done_keys))

    def clear(self) -> None:
        """Forget the in-flight iterations (after the runtime dropped them: recovery, resume)."""
        self._unfinished = []

    def tidy(
        self, engine: Engine, runtime: Runtime, trace: Trace, next_iteration: int, next_step: int
    ) -> None:
        """Free finished iterations, trim the trace, and forget old finished tasks."""
        still = []
        for iteration, keys in self._unfinished:
            if all(engine.is_done(k) for k in keys):
                runtime.end_iteration(iteration)
            else:
                still.append((iteration, keys))
        self._unfinished = still
        keep = self.trace_iterations
        oldest = next_iteration - keep
        trim_trace(trace, oldest, next_step - keep)
        engine.forget(forget_horizon(oldest, next_step))
