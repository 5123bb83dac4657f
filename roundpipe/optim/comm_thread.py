"""The thread that issues roundpipe's collectives, in one order on every process.

Why a thread of its own: a unit's gradient average travels while the optimizer lane steps the
unit before it (the heavy CPU work of a step), instead of the lane waiting for the bytes. Why one
order: gloo matches collectives by the order each process issues them, and the moments at which
gradients become complete differ between processes. So this thread walks the scheduled steps in
order and, within a step, the units deepest first (their gradients land first), and for each it
waits until the unit is *ready* (its last G-copy of the step ran: `after_g_copy`, or its step
task started), runs the work, and marks it *done*; the step task waits for *done*. When a weight
check is due after a step, it waits until that step was applied everywhere (*stepped*) and runs
the check, so that collective also keeps its place in the order.

An idle thread ends after ``idle_s`` and is started again by the next event, so a pipe that is
dropped leaves no thread waiting for ever. This module must never touch tensors: the work is
given as callables.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

Event = tuple[str, int, int]  # (what, step, unit): "ready" | "done" | "stepped" | "checked"


class OrderedCollectives:
    """Runs ``average(step, unit)`` for each scheduled step and each unit of ``order`` once the
    unit is ready, then ``check(step)`` where ``check_due(step)``, all on one thread, in order."""

    def __init__(
        self,
        order: list[int],
        average: Callable[[int, int], None],
        check: Callable[[int], None],
        check_due: Callable[[int], bool],
        *,
        idle_s: float,
    ) -> None:
        self.order = order
        self._average = average
        self._check = check
        self._check_due = check_due
        self.idle_s = idle_s
        self._cv = threading.Condition()
        self._events: set[Event] = set()
        self._steps: deque[int] = deque()  # scheduled steps whose work is not finished
        self._last_scheduled = -1
        self._position = 0  # index in ``order`` of the next unit of ``_steps[0]``
        self._step_of_last: dict[int, int] = {}  # a step's last iteration -> that step
        self._copied: dict[int, set[int]] = {}  # iteration -> units whose G-copy ran
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ events (any thread)

    def step_scheduled(self, step: int, last_iteration: int) -> None:
        """Step ``step`` applies the gradients of iterations up to ``last_iteration``."""
        with self._cv:
            if step <= self._last_scheduled:  # numbering restarted (a state was loaded): start over
                self._steps.clear()
                self._events.clear()
                self._position = 0
            self._schedule(step)
            self._step_of_last = {last_iteration: step}
            for unit in self._copied.pop(last_iteration, ()):
                self._mark(("ready", step, unit))
            self._copied = {it: units for it, units in self._copied.items() if it > last_iteration}
            self._ensure_thread()

    def after_g_copy(self, iteration: int, unit: int) -> None:
        with self._cv:
            step = self._step_of_last.get(iteration)
            if step is None:
                self._copied.setdefault(iteration, set()).add(unit)
            else:
                self._mark(("ready", step, unit))

    def ready(self, step: int, unit: int) -> None:
        """``unit``'s gradient for ``step`` is complete (its step task runs)."""
        with self._cv:
            self._schedule(step)
            self._mark(("ready", step, unit))

    def stepped(self, step: int) -> None:
        with self._cv:
            self._mark(("stepped", step, -1))

    def wait(self, what: str, step: int, unit: int = -1) -> None:
        """Block until event (what, step, unit); raise what failed on the thread instead."""
        key = (what, step, unit)
        with self._cv:
            while key not in self._events:
                if self._error is not None:
                    raise self._error
                self._ensure_thread()
                self._cv.wait(timeout=1.0)

    # ------------------------------------------------------------------ internals (lock held)

    def _schedule(self, step: int) -> None:
        if step > self._last_scheduled:
            self._steps.append(step)
            self._last_scheduled = step

    def _mark(self, key: Event) -> None:
        self._events.add(key)
        self._cv.notify_all()
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None and self._steps and self._error is None:
            self._thread = threading.Thread(target=self._work, name="roundpipe-collectives", daemon=True)
            self._thread.start()

    def _next(self) -> tuple[int, int, Event] | None:
        """The next item (step, unit or -1 for the check, the event it waits for), or None when
        nothing is left; a finished step is dropped on the way."""
        while self._steps:
            step = self._steps[0]
            if self._position < len(self.order):
                unit = self.order[self._position]
                return step, unit, ("ready", step, unit)
            if self._check_due(step) and ("checked", step, -1) not in self._events:
                return step, -1, ("stepped", step, -1)
            self._steps.popleft()
            self._position = 0
            self._events = {e for e in self._events if e[1] >= step - 1}
        return None

    def _has(self, key: Event) -> Callable[[], bool]:
        return lambda: key in self._events

    # ------------------------------------------------------------------ the thread

    def _work(self) -> None:
        try:
            while True:
                with self._cv:
                    item = self._next()
                    if item is None or not self._cv.wait_for(self._has(item[2]), self.idle_s):
                        self._thread = None  # nothing to do, or idle: the next event starts another
                        return
                step, unit, _ = item
                if unit >= 0:
                    self._average(step, unit)
                else:
                    self._check(step)
                with self._cv:
                    if unit >= 0:
                        self._position += 1
                        self._mark(("done", step, unit))
                    else:
                        self._mark(("checked", step, -1))
        except BaseException as exc:  # handed to the optimizer lane, which raises it
            with self._cv:
                self._error = exc
                self._thread = None
                self._cv.notify_all()
