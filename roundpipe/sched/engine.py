"""The event-driven engine: starts each task when its dependencies are done and its lane is free.

Why an engine and not hand-written waits: every ordering constraint in roundpipe (the five rules,
one-stage prefetch, activation flow, one task at a time per lane) is a declared dependency or a
lane, so a schedule can be printed, checked, simulated and replayed, and a stuck task can name
what it waits for. The engine never runs tensor math, never blocks and never imports torch.

The life of a task, in order (threads in brackets):
  1. [caller] `RoundPipe.forward_backward` hands the work to the loop thread
     (``run_coroutine_threadsafe``); [loop] `RoundPipe._submit_iteration` stores the iteration's
     inputs (`Runtime.begin_iteration`) and asks `GraphBuilder.forward_backward` for the tasks
     (state NEW: key, kind, lane, priority, deps declared by key).
  2. [loop] `Engine.submit` indexes them by key, links each to its dependencies' ``dependents``
     (or parks it under a key not yet submitted), counts ``unmet`` (WAITING), checks a batch with
     backward edges for cycles; tasks with nothing unmet go to `_push_ready`: READY, on their
     resource's heap, keyed (-priority, seq) so the most urgent, then the oldest, comes first.
  3. [loop] `_start_free` / `_start_next` pop the heap of every idle resource: RUNNING, then
     ``backend.start(task)``.
  4. Real backends (`LaneThreadBackend.start`): [lane thread, one per lane] `_run` ->
     `execute` -> `Runtime.run` -> the kind's handler (`Runtime.param_up`, `compute`, ...; on CUDA
     inside the lane's stream) -> `CompletionPipe.put`, which batches completions and schedules
     one ``call_soon_threadsafe(_drain)``; [loop] `_drain` calls `Engine._task_done` per task.
     On CUDA (``issues_ahead``) `execute` only *issues* the work on the lane's stream, behind
     ``stream.wait_event`` on its same-device dependencies, and returns a waiter:
     `CompletionPipe.put_issued` -> [loop] `Engine._task_issued` (ISSUED: the lane is free and
     the same-device tasks waiting on its issue may start); [waiter thread, one per lane] the
     blocking end event completes, `Runtime.finish` releases what the work held, and
     `CompletionPipe.put` reports it done.
     The fake backend instead pushes the task's end time on a heap; `wait` (`waiting.py`) calls
     ``backend.advance()``, which moves the virtual clock and calls `_task_done` directly
     (`FakeStreamBackend` also reports issues, modelling streams).
  5. [loop] `_task_done`: DONE and appended to the trace (or FAILED, and `_poison` cancels its
     dependents transitively); `_release_dependents` counts each dependent down and pushes those
     at zero (READY); `_task_done` then starts the freed resource and theirs (held while another
     virtual task ends at the same instant, so the most urgent of all goes first); the wakeup
     future of a sleeping `wait` is resolved.
  6. [loop] `wait_until_done` sees the awaited keys (the loss computes) DONE and returns;
     `RoundPipe` reads the losses, later frees finished iterations and `forget`s old keys.
On a failure the engine lets unrelated work finish, then `wait` raises `TaskFailedError` naming
the task; `cancel_pending()` drops the rest so the owner can continue or close.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable

from roundpipe.errors import ScheduleError
from roundpipe.sched.backend import Backend
from roundpipe.sched.diagnostics import released_by
from roundpipe.sched.keys import Age, key_age
from roundpipe.sched.kinds import TaskState
from roundpipe.sched.task import Key, Task
from roundpipe.sched.trace import Trace
from roundpipe.sched.upkeep import EngineUpkeep
from roundpipe.sched.waiting import wait_until_done

# States under short names: the hot paths read module globals, not enum class attributes.
_WAITING = TaskState.WAITING
_READY = TaskState.READY
_RUNNING = TaskState.RUNNING
_ISSUED = TaskState.ISSUED
_DONE = TaskState.DONE
_FAILED = TaskState.FAILED
_CANCELLED = TaskState.CANCELLED
_FINISHED = (_CANCELLED, _FAILED, _DONE)


class _Resource:
    __slots__ = ("busy", "heap", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = False
        self.heap: list[tuple[int, int, Task]] = []


_FREED_AT_ISSUE = _Resource("freed at issue")  # stands in for the lane of an issued task
_FREED_AT_ISSUE.busy = True  # never started from


class Engine(EngineUpkeep):
    """Runs task graphs on one backend. Use from one event loop (the loop thread)."""

    def __init__(self, backend: Backend, *, trace: Trace | None = None, stall_timeout_s: float | None = None):
        self.backend = backend
        self.trace = trace if trace is not None else Trace()
        self.stall_timeout_s = stall_timeout_s
        self._tasks: dict[Key, Task] = {}
        self._missing: dict[Key, list[Task]] = {}
        self._resources: dict[str, _Resource] = {}
        self._resource_of_lane: dict[str, _Resource] = {}
        self._seq = 0
        self._pending = 0  # submitted and not done
        self._ready = 0
        self._running = 0
        self._done = 0
        self._failed: list[Task] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._virtual = bool(backend.virtual)
        # Device work may be issued before what it depends on has completed (see Backend).
        self._ahead = bool(getattr(backend, "issues_ahead", False))
        self._held: list[_Resource] = []  # resources freed at an instant that is not over yet
        self._forgotten: Callable[[Key], bool] | None = None  # see forget()
        self._finished_by_age: dict[Age, list[Key]] = {}  # finished keys by `key_age`, for forget()
        self._finished_ageless: dict[Key, None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bound = False

    # ------------------------------------------------------------------ submission

    def submit(self, tasks: Iterable[Task]) -> None:
        """Add tasks to the graph. Dependencies may name tasks submitted earlier, in this batch,
        or later (those keep the task waiting; `wait` reports them if they never come)."""
        self._bind()
        new = list(tasks)
        self._register(new)
        now = self.backend.now()
        backward = self._link(new, now)
        missing = self._missing
        if missing:
            for task in new:
                waiting = missing.pop(task.key, None)
                if waiting:  # tasks of earlier batches: they cannot close a cycle in this one
                    task.dependents.extend(waiting)
        self._pending += len(new)
        if backward:
            self._check_acyclic(new)
        touched = [self._push_ready(task, now) for task in new if task.unmet == 0]
        self._start_free(touched)

    def _register(self, new: list[Task]) -> None:
        """Index a batch by key and number it; a duplicate key refuses the whole batch."""
        by_key = self._tasks
        seq = self._seq
        for task in new:
            key = task.key
            if key in by_key:
                self._forget_partial(new, task)
                raise ScheduleError(f"duplicate task key {key!r}: {task.describe()}")
            by_key[key] = task
            task.seq = seq
            seq += 1
        self._seq = seq

    def _link(self, new: list[Task], now: float) -> bool:
        """Count each task's unmet dependencies and list it with what it waits for. Returns
        whether a task depends on a later one of the batch: a batch is acyclic when none does
        (graph builders emit tasks in dependency order), and only then is the full check skipped."""
        by_key = self._tasks
        missing = self._missing
        forgotten = self._forgotten
        ahead = self._ahead
        backward = False
        for task in new:
            unmet = 0
            for dep_key in task.deps:
                dep = by_key.get(dep_key)
                if dep is None:
                    if forgotten is not None and forgotten(dep_key):
                        continue  # finished long ago and forgotten
                    waiting = missing.get(dep_key)
                    if waiting is None:
                        missing[dep_key] = [task]
                    else:
                        waiting.append(task)
                    unmet += 1
                elif ahead and dep.device == task.device >= 0 and dep_key not in task.sync_deps:
                    # Same device: ordered on the device, so issued is enough. Across devices (and
                    # for host work) completion: a stream that waits on another device's far-off
                    # event would hold back everything issued behind it.
                    if dep.state is not _DONE and dep.state is not _ISSUED:
                        dep.issue_dependents.append(task)
                        unmet += 1
                        backward = backward or dep.seq >= task.seq
                elif dep.state is not _DONE:
                    dep.dependents.append(task)
                    unmet += 1
                    backward = backward or dep.seq >= task.seq
            task.unmet = unmet
            task.state = _WAITING
            task.submit_t = now
        return backward

    # ------------------------------------------------------------------ running

    def _bind(self) -> None:
        if self._bound:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        if self._ahead:
            self.backend.bind(self._task_done, self._loop, self._task_issued)  # type: ignore[call-arg]
        else:
            self.backend.bind(self._task_done, self._loop)
        self._bound = True

    def _resource(self, lane: str) -> _Resource:
        res = self._resource_of_lane.get(lane)
        if res is None:
            name = self.backend.resource(lane)
            res = self._resources.get(name)
            if res is None:
                res = self._resources[name] = _Resource(name)
            self._resource_of_lane[lane] = res
        return res

    def _push_ready(self, task: Task, now: float) -> _Resource:
        task.state = _READY
        task.ready_t = now
        res = self._resource_of_lane.get(task.lane) or self._resource(task.lane)
        heapq.heappush(res.heap, (-task.priority, task.seq, task))
        self._ready += 1
        return res

    def _start_free(self, resources: list[_Resource]) -> None:
        # Called after *all* newly ready tasks are pushed, so the most urgent one starts first.
        for res in resources:
            if not res.busy and res.heap:
                self._start_next(res)

    def _start_next(self, res: _Resource) -> None:
        heap = res.heap
        task = heapq.heappop(heap)[2]
        while task.state is _CANCELLED:
            if not heap:
                return
            task = heapq.heappop(heap)[2]
        self._ready -= 1
        res.busy = True
        task.state = _RUNNING
        task.start_t = self.backend.now()
        self._running += 1
        self.backend.start(task)

    def _task_issued(self, task: Task) -> None:
        """A device task's work is queued on its device: its lane may issue the next task, and
        the device tasks that depend on it (and on nothing unissued) may be issued too. It still
        counts as running until `_task_done`."""
        if task.state is not _RUNNING:
            return  # failed or cancelled meanwhile
        now = self.backend.now()
        task.state = _ISSUED
        if task.issue_t < 0:  # a lane thread stamps the moment it finished issuing; else now
            task.issue_t = now
        res = self._resource_of_lane[task.lane]
        res.busy = False
        touched = [res]
        dependents, task.issue_dependents = task.issue_dependents, []
        for dep in dependents:
            dep.unmet -= 1
            if dep.unmet == 0 and dep.state is _WAITING:
                touched.append(self._push_ready(dep, now))
        self._start_free(touched)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _task_done(self, task: Task, error: BaseException | None = None) -> None:
        """The completion callback (the hot path: one call per finished task): record the end,
        free the task's resource, release or cancel its dependents, start what may start, and
        wake `wait`. Starting is inlined `_start_free`, in its order: the held resources, the
        freed one, then those of the newly ready tasks."""
        now = self.backend.now()
        if task.end_t < 0.0:  # a backend that times tasks on the device has set it already
            task.end_t = now
        self._running -= 1
        res = self._resource_of_lane[task.lane]
        if task.state is _ISSUED:
            # Its lane was freed at issue and its device dependents released then: start nothing
            # on the lane here.
            res = _FREED_AT_ISSUE
        else:
            res.busy = False
            if task.issue_dependents:  # done without a separate issue report (host work)
                task.dependents = task.issue_dependents + task.dependents
                task.issue_dependents = []
        if error is not None:
            self._task_failed(task, error, res)
        else:
            task.state = _DONE
            self._pending -= 1
            self._done += 1
            self.trace.records.append(task)
            age = key_age(task.key)
            if age is None:
                self._finished_ageless[task.key] = None
            else:
                self._finished_by_age.setdefault(age, []).append(task.key)
            others = self._release_dependents(task, res, now) if task.dependents else None
            if self._virtual and self.backend.next_time() == now:
                # Another task finishes at this same instant: start nothing until its dependents
                # are ready too, so the most urgent of them all goes first, not the first popped.
                self._held.append(res)
                if others is not None:
                    self._held.extend(others)
            else:
                if self._held:
                    held, self._held = self._held, []
                    self._start_free(held)
                if res.heap and not res.busy:
                    self._start_next(res)
                if others is not None:
                    self._start_free(others)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _task_failed(self, task: Task, error: BaseException, res: _Resource) -> None:
        task.state = _FAILED
        task.error = error
        self._failed.append(task)
        self._pending -= 1
        self._poison(task)
        self._start_free([*self._held, res])
        self._held = []

    def _release_dependents(self, task: Task, res: _Resource, now: float) -> list[_Resource] | None:
        """Count down the dependents of a finished task and push those left with no unmet
        dependency onto their resource's heap (`_push_ready` for a whole list at once: this runs
        for every task, and a call per dependent would cost more than the push). Returns the idle
        resources, other than ``res``, that got ready work, in dependents order."""
        others: list[_Resource] | None = None
        resource_of_lane = self._resource_of_lane
        heappush = heapq.heappush
        pushed = 0
        for dep in task.dependents:
            unmet = dep.unmet - 1
            dep.unmet = unmet
            if unmet:
                continue
            dep.state = _READY
            dep.ready_t = now
            target = resource_of_lane.get(dep.lane) or self._resource(dep.lane)
            heappush(target.heap, (-dep.priority, dep.seq, dep))
            pushed += 1
            if target is not res and not target.busy:
                if others is None:
                    others = [target]
                else:
                    others.append(target)
        self._ready += pushed
        task.dependents = []
        return others

    def _poison(self, failed: Task) -> None:
        """Cancel everything that depends on a failed task, transitively; unrelated work goes on,
        so the host state ends consistent (every step either fully applied or not at all)."""
        stack = released_by(failed)
        failed.dependents = []
        failed.issue_dependents = []
        while stack:
            task = stack.pop()
            if task.state in _FINISHED or task.state is _RUNNING or task.state is _ISSUED:
                continue  # running and issued work completes (or fails) on its own
            if task.state == _READY:
                self._ready -= 1  # its heap entry is skipped when popped
            task.state = _CANCELLED
            self._pending -= 1
            stack.extend(released_by(task))
            task.dependents = []
            task.issue_dependents = []

    # ------------------------------------------------------------------ waiting

    def task(self, key: Key) -> Task:
        try:
            return self._tasks[key]
        except KeyError:
            raise ScheduleError(f"no task with key {key!r} was submitted") from None

    async def wait(self, keys: Iterable[Key] | None = None) -> None:
        """Run until the given tasks (default: everything submitted) are done.

        Raises `TaskFailedError` (after the running tasks have finished) when any task failed,
        and `ScheduleError` when nothing can make progress any more.
        """
        self._bind()
        await wait_until_done(self, None if keys is None else [self.task(k) for k in keys])
