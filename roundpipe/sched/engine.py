"""The event-driven engine: starts each task when its dependencies are done and its lane is free.

Why an engine and not hand-written waits: every ordering constraint in roundpipe (the five rules,
one-stage prefetch, activation flow, one task at a time per lane) is a declared dependency or a
lane, so a schedule can be printed, checked, simulated and replayed, and a stuck task can name
what it waits for. The engine itself is small and cheap:

- a task keeps a count of unmet dependencies and a list of dependents; completing a task
  decrements its dependents and pushes those that reach zero onto their resource's ready heap,
  keyed by (-priority, sequence) so the most urgent, then the oldest, starts first;
- the engine never runs tensor math and never blocks: virtual backends are advanced in a tight
  loop, real backends report completions through ``call_soon_threadsafe``;
- on a failure the engine cancels everything that depends on the failed task, lets unrelated
  work finish (so host state ends consistent), then raises `TaskFailedError` in whoever waits,
  naming the task; `cancel_pending()` then drops the rest so the owner can continue or close.

The engine must never import torch or know what a task does.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from roundpipe.errors import ScheduleError, TaskFailedError
from roundpipe.sched.backend import Backend
from roundpipe.sched.kinds import TaskState
from roundpipe.sched.task import Key, Task
from roundpipe.sched.trace import Trace

# States under short names: the hot paths read module globals, not enum class attributes.
_WAITING = TaskState.WAITING
_READY = TaskState.READY
_RUNNING = TaskState.RUNNING
_DONE = TaskState.DONE
_FAILED = TaskState.FAILED
_CANCELLED = TaskState.CANCELLED
_FINISHED = (_CANCELLED, _FAILED, _DONE)

_YIELD_EVERY = 4096  # virtual events between yields to the loop, so other coroutines keep ticking
# What one stretch of virtual events ended with (see `Engine._advance_virtual`).
_STUCK = "stuck"  # nothing was running
_PROGRESS = "progress"  # the awaited tasks are done, or a task failed
_BUDGET_SPENT = "budget spent"  # _YIELD_EVERY events ran: yield to the loop, then go on


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


class _Resource:
    __slots__ = ("busy", "heap", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = False
        self.heap: list[tuple[int, int, Task]] = []


class Engine:
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
        self._held: list[_Resource] = []  # resources freed at an instant that is not over yet
        self._forgotten: Callable[[Key], bool] | None = None  # see forget()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bound = False

    # ------------------------------------------------------------------ submission

    def submit(self, tasks: Iterable[Task]) -> None:
        """Add tasks to the graph. Dependencies may name tasks submitted earlier, in this batch,
        or later (those keep the task waiting; `wait` reports them if they never come)."""
        self._bind()
        new = list(tasks)
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
        now = self.backend.now()
        missing = self._missing
        forgotten = self._forgotten
        # A batch is acyclic when no task depends on a task that comes after it in the batch
        # (graph builders emit tasks in dependency order); only then is the full check skipped.
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
                elif dep.state != _DONE:
                    dep.dependents.append(task)
                    unmet += 1
                    if dep.seq >= task.seq:
                        backward = True
            task.unmet = unmet
            task.state = _WAITING
            task.submit_t = now
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

    def _forget_partial(self, new: list[Task], duplicate: Task) -> None:
        """Undo the key registrations of a batch refused for a duplicate key (up to ``duplicate``)."""
        for task in new:
            if task is duplicate:
                return
            self._tasks.pop(task.key, None)
            task.seq = -1

    def _check_acyclic(self, new: list[Task]) -> None:
        """Kahn's algorithm over the edges inside this batch; a leftover means a cycle."""
        in_batch = {id(t) for t in new}
        indegree: dict[int, int] = {}
        for task in new:
            for dep in task.dependents:
                if id(dep) in in_batch:
                    indegree[id(dep)] = indegree.get(id(dep), 0) + 1
        stack = [t for t in new if id(t) not in indegree]
        visited = 0
        while stack:
            task = stack.pop()
            visited += 1
            for dep in task.dependents:
                if id(dep) in in_batch:
                    indegree[id(dep)] -= 1
                    if indegree[id(dep)] == 0:
                        stack.append(dep)
        if visited == len(new):
            return
        cycle = _find_cycle([t for t in new if indegree.get(id(t), 0) > 0], in_batch)
        # Leave the engine usable: forget the whole malformed batch.
        for task in new:
            self._tasks.pop(task.key, None)
            task.state = _CANCELLED
        self._pending -= len(new)
        for task in self._tasks.values():
            task.dependents = [d for d in task.dependents if d.state != _CANCELLED]
        for key in list(self._missing):
            self._missing[key] = [d for d in self._missing[key] if d.state != _CANCELLED]
            if not self._missing[key]:
                del self._missing[key]
        path = " -> ".join(t.describe() for t in cycle)
        raise ScheduleError(f"dependency cycle: {path} -> {cycle[0].describe()}")

    # ------------------------------------------------------------------ running

    def _bind(self) -> None:
        if self._bound:
            return
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
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
        while task.state == _CANCELLED:
            if not heap:
                return
            task = heapq.heappop(heap)[2]
        self._ready -= 1
        res.busy = True
        task.state = _RUNNING
        task.start_t = self.backend.now()
        self._running += 1
        self.backend.start(task)

    def _task_done(self, task: Task, error: BaseException | None = None) -> None:
        # The hot path: one call per finished task. It does the work of `_push_ready` and
        # `_start_free` inline (same order: the freed resource first, then the resources of the
        # newly ready tasks in dependents order) because method calls dominate its cost.
        now = self.backend.now()
        task.end_t = now
        self._running -= 1
        res = self._resource_of_lane[task.lane]
        res.busy = False
        if error is not None:
            task.state = _FAILED
            task.error = error
            self._failed.append(task)
            self._pending -= 1
            self._poison(task)
            self._start_free([*self._held, res])
            self._held = []
        else:
            task.state = _DONE
            self._pending -= 1
            self._done += 1
            self.trace.records.append(task)
            dependents = task.dependents
            others: list[_Resource] | None = None
            if dependents:
                resource_of_lane = self._resource_of_lane
                heappush = heapq.heappush
                pushed = 0
                for dep in dependents:
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
            if self._virtual and self.backend.next_time() == now:
                # Another task finishes at this same instant: start nothing until its dependents
                # are ready too, so the most urgent of them all goes first, not the first popped.
                self._held.append(res)
                if others is not None:
                    self._held.extend(others)
            else:
                if self._held:
                    held, self._held = self._held, []
                    for target in held:
                        if not target.busy and target.heap:
                            self._start_next(target)
                if res.heap and not res.busy:
                    self._start_next(res)
                if others is not None:
                    for target in others:
                        if not target.busy and target.heap:
                            self._start_next(target)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _poison(self, failed: Task) -> None:
        """Cancel everything that depends on a failed task, transitively; unrelated work goes on,
        so the host state ends consistent (every step either fully applied or not at all)."""
        stack = list(failed.dependents)
        failed.dependents = []
        while stack:
            task = stack.pop()
            if task.state in _FINISHED:
                continue
            if task.state == _READY:
                self._ready -= 1  # its heap entry is skipped when popped
            task.state = _CANCELLED
            self._pending -= 1
            stack.extend(task.dependents)
            task.dependents = []

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
        targets = None if keys is None else [self.task(k) for k in keys]
        index = 0
        backend = self.backend
        while True:
            if self._failed and self._running == 0 and self._ready == 0:
                self._raise_failure()
            if self._failed:
                pass  # keep running unrelated work until the failure is isolated
            elif targets is None:
                if self._pending == 0:
                    return
            else:
                while index < len(targets) and targets[index].state == _DONE:
                    index += 1
                if index == len(targets):
                    return
            if backend.virtual:
                outcome = self._advance_virtual(targets[index] if targets is not None else None)
                if outcome is _STUCK:
                    if self._failed:
                        self._raise_failure()
                    self._raise_stall(targets[index:] if targets is not None else None)
                if outcome is _BUDGET_SPENT:
                    await asyncio.sleep(0)  # let other coroutines on the loop tick
            else:
                if self._running == 0:
                    if self._failed:
                        self._raise_failure()
                    self._raise_stall(targets[index:] if targets is not None else None)
                await self._sleep_until_progress()

    def _advance_virtual(self, target: Task | None) -> str:
        """Complete up to `_YIELD_EVERY` virtual events; stop early when ``target`` (None: every
        submitted task) is done or a task failed, so `wait` can re-check its exit conditions."""
        advance = self.backend.advance
        for _ in range(_YIELD_EVERY):
            if not advance():
                return _STUCK
            if self._failed:
                return _PROGRESS
            if target is None:
                if self._pending == 0:
                    return _PROGRESS
            elif target.state == _DONE:
                return _PROGRESS
        return _BUDGET_SPENT

    async def _sleep_until_progress(self) -> None:
        loop = asyncio.get_running_loop()
        self._wakeup = loop.create_future()
        try:
            if self.stall_timeout_s is None:
                await self._wakeup
            else:
                try:
                    await asyncio.wait_for(asyncio.shield(self._wakeup), self.stall_timeout_s)
                except asyncio.TimeoutError:
                    running = [t for t in self._tasks.values() if t.state == _RUNNING]
                    names = "; ".join(t.describe() for t in running[:8])
                    raise ScheduleError(
                        f"watchdog: no task finished for {self.stall_timeout_s:.1f} s; still running: {names}"
                    ) from None
        finally:
            self._wakeup = None

    def _raise_failure(self) -> None:
        task = self._failed[0]
        error = task.error
        if isinstance(error, TaskFailedError):
            raise error
        raise TaskFailedError(
            f"task failed: {task.describe()}: {type(error).__name__}: {error}", task.describe()
        ) from error

    def _raise_stall(self, targets: list[Task] | None) -> None:
        stuck = [t for t in self._tasks.values() if t.state == _WAITING]
        lines = []
        for task in stuck[:10]:
            unmet = [k for k in task.deps if k not in self._tasks or self._tasks[k].state != _DONE]
            shown = ", ".join(_describe_key(k, self._tasks) for k in unmet[:4])
            lines.append(f"  {task.describe()} waits for: {shown}")
        more = f"\n  ... and {len(stuck) - 10} more" if len(stuck) > 10 else ""
        what = f"{len(targets)} awaited task(s)" if targets is not None else f"{self._pending} task(s)"
        raise ScheduleError(
            f"stalled: {what} can never run; nothing is running or ready.\n" + "\n".join(lines) + more
        )

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
        (each call's predicate accepts every key the previous one did)."""
        self._forgotten = older
        for key, task in list(self._tasks.items()):
            if task.state == _DONE and older(key):
                del self._tasks[key]

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


def _describe_key(key: Key, tasks: dict[Key, Task]) -> str:
    task = tasks.get(key)
    if task is None:
        return f"{key!r} (never submitted)"
    return f"{task.describe()} ({task.state})"


def _find_cycle(candidates: list[Task], in_batch: set[int]) -> list[Task]:
    """A concrete cycle among tasks that Kahn's algorithm could not order."""
    cand = {id(t) for t in candidates}
    for start in candidates:
        path: list[Task] = []
        on_path: dict[int, int] = {}
        node: Task | None = start
        while node is not None and id(node) not in on_path:
            on_path[id(node)] = len(path)
            path.append(node)
            node = next((d for d in node.dependents if id(d) in cand and id(d) in in_batch), None)
        if node is not None:
            return path[on_path[id(node)] :]
    return candidates[:1]
