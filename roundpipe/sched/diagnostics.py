"""What the engine says when a graph cannot run: cycles, stalls, failures and a silent device.

Why apart from the engine: these run once, when something is already wrong, and their job is a
message a person can act on (which tasks, waiting for what, in what state); the engine's own
module stays the short hot path. Everything here only reads tasks: it must never change a task's
state or the engine's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterable

from roundpipe.errors import TaskFailedError
from roundpipe.sched.kinds import TaskState
from roundpipe.sched.task import Key, Task


def released_by(task: Task) -> list[Task]:
    """Every task waiting on ``task`` (for its issue or for its completion)."""
    return task.issue_dependents + task.dependents if task.issue_dependents else task.dependents


def find_cycle(batch: list[Task]) -> list[Task] | None:
    """A dependency cycle among the tasks of ``batch`` (by their ``dependents`` and
    ``issue_dependents`` links inside the batch), or None when Kahn's algorithm orders them all."""
    in_batch = {id(t) for t in batch}
    indegree: dict[int, int] = {}
    for task in batch:
        for dep in released_by(task):
            if id(dep) in in_batch:
                indegree[id(dep)] = indegree.get(id(dep), 0) + 1
    stack = [t for t in batch if id(t) not in indegree]
    visited = 0
    while stack:
        task = stack.pop()
        visited += 1
        for dep in released_by(task):
            if id(dep) in in_batch:
                indegree[id(dep)] -= 1
                if indegree[id(dep)] == 0:
                    stack.append(dep)
    if visited == len(batch):
        return None
    return _concrete_cycle([t for t in batch if indegree.get(id(t), 0) > 0], in_batch)


def _concrete_cycle(candidates: list[Task], in_batch: set[int]) -> list[Task]:
    """A concrete cycle among tasks that Kahn's algorithm could not order."""
    cand = {id(t) for t in candidates}
    for start in candidates:
        path: list[Task] = []
        on_path: dict[int, int] = {}
        node: Task | None = start
        while node is not None and id(node) not in on_path:
            on_path[id(node)] = len(path)
            path.append(node)
            node = next((d for d in released_by(node) if id(d) in cand and id(d) in in_batch), None)
        if node is not None:
            return path[on_path[id(node)] :]
    return candidates[:1]


def cycle_message(cycle: list[Task]) -> str:
    path = " -> ".join(t.describe() for t in cycle)
    return f"dependency cycle: {path} -> {cycle[0].describe()}"


def failure_error(task: Task) -> TaskFailedError:
    """The error `Engine.wait` raises for a failed task, naming it and its cause."""
    error = task.error
    return TaskFailedError(
        f"task failed: {task.describe()}: {type(error).__name__}: {error}",
        task.describe(),
        task.iteration if task.iteration >= 0 else None,
    )


def stall_message(tasks: dict[Key, Task], awaited: int | None, pending: int) -> str:
    """Why nothing can run: up to ten waiting tasks and up to four unmet dependencies of each."""
    stuck = [t for t in tasks.values() if t.state == TaskState.WAITING]
    lines = []
    for task in stuck[:10]:
        unmet = [k for k in task.deps if k not in tasks or tasks[k].state != TaskState.DONE]
        shown = ", ".join(_describe_key(k, tasks) for k in unmet[:4])
        lines.append(f"  {task.describe()} waits for: {shown}")
    more = f"\n  ... and {len(stuck) - 10} more" if len(stuck) > 10 else ""
    what = f"{awaited} awaited task(s)" if awaited is not None else f"{pending} task(s)"
    return f"stalled: {what} can never run; nothing is running or ready.\n" + "\n".join(lines) + more


def watchdog_message(tasks: Iterable[Task], timeout_s: float) -> str:
    running = [t for t in tasks if t.state == TaskState.RUNNING]
    names = "; ".join(t.describe() for t in running[:8])
    return f"watchdog: no task finished for {timeout_s:.1f} s; still running: {names}"


def _describe_key(key: Key, tasks: dict[Key, Task]) -> str:
    task = tasks.get(key)
    if task is None:
        return f"{key!r} (never submitted)"
    return f"{task.describe()} ({task.state})"
