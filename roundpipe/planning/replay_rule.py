"""The engine's start rule on integers: the replay loop behind `roundpipe.planning.replay`.

Why a module of its own: `roundpipe.planning.replay` turns replays into iteration times (settled
runs, estimates, the second submission on a worker); this is the rule itself, replayed on a
`ReplayGraph` (the module docstring of `roundpipe.planning.replay` states it: resources, priorities,
waves, batches), in Python where the compiled loop (`roundpipe.plan.native`) is absent and the
reference it is checked against. It must never import the scheduler or torch, and never differ
from the engine's order: `tests/test_plan_replay.py` and `tests/test_native_kernels.py` compare.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from roundpipe.plan import native
from roundpipe.planning.replay_graph import ReplayGraph


def replay_starts(
    graph: ReplayGraph, stop: bytearray | None = None, *, loop: bool = False, loss_lag: int = 0
) -> Sequence[float]:
    """Every task's start time (ms) under the engine's start rule (see the module docstring), -1
    where a task did not start. With ``stop`` (a flag per task), the replay ends at the first
    instant a flagged task starts: later starts cannot come earlier.

    The batches are submitted as `roundpipe.planning.simulate.run_fake` submits them: all at time 0, or
    (``loop``, its ``after_loss``) as a training loop does: iteration t's optimizer step and
    iteration t + 1's graph once iteration t's losses are all in and their instant is over (a
    virtual `Engine.wait` returns then: `roundpipe.sched.waiting`). With ``loss_lag=1`` the loop
    reads each loss one iteration late (`RoundPipe.forward_backward(..., wait=False)`): iterations
    0 and 1 and their steps go in at once, and iteration t's losses let in iteration t + 2 and its
    step."""
    return replay_run(graph, stop, loop=loop, loss_lag=loss_lag)[0]


def replay_run(
    graph: ReplayGraph,
    stop: bytearray | None = None,
    *,
    loop: bool = False,
    loss_lag: int = 0,
    beyond: int | None = None,
) -> tuple[Sequence[float], float]:
    """`replay_starts`, and the earliest start of a task numbered ``beyond`` or more (-1 where none
    started): whether the tasks of the batches from there on could have changed anything up to
    a time (`_loop_runs`' long run read for its short one)."""
    count = len(graph.res)
    beyond = count if beyond is None else beyond
    flags = stop if stop is not None else bytearray(count)
    # Loop submission: ``released`` batches may go in; iteration t's last loss releases two more.
    if loss_lag not in (0, 1):
        raise ValueError(f"a loop replay reads losses 0 or 1 iteration late, not {loss_lag}")
    loss_of = bytearray(count)  # 1 + the iteration, for an iteration's loss computes (up to 254)
    losses_left: list[int] = []
    if loop:
        if len(graph.losses) > 254:
            raise ValueError(f"a loop replay takes up to 254 iterations, not {len(graph.losses)}")
        for it, losses in enumerate(graph.losses):
            losses_left.append(len(losses))
            for task in losses:
                loss_of[task] = it + 1
    kernels = native.kernels()
    if kernels is not None:  # the same loop, compiled (`native`)
        start, stalled, earliest = kernels.replay(
            *graph.packed(),
            *(loss_of, native.ints(losses_left), flags, graph.host + 1, graph.seq, loop, loss_lag, beyond),
        )
    else:
        start, stalled, earliest = _replay(graph, flags, loop, loss_lag, loss_of, losses_left, beyond)
    if stalled:
        raise RuntimeError(f"replay stalled: {stalled} of {count} tasks never ran")
    return start, earliest


class _Replay:
    """`replay_run`'s state while it runs: the ready heaps, the free resources, the tasks running
    (``timed``: ending later; ``wave``: ending now) and the loop's submission count."""

    def __init__(self, graph: ReplayGraph, loop: bool, loss_lag: int) -> None:
        self.graph = graph
        self.unmet = list(graph.unmet)
        self.start = [-1.0] * len(graph.res)
        self.heaps: list[list[int]] = [[] for _ in range(graph.host + 1)]
        self.free = [True] * (graph.host + 1)
        self.timed: list[tuple[float, int]] = []
        self.wave: list[int] = []
        self.now, self.done, self.first, self.earliest = 0.0, 0, 0, -1.0
        self.batches = list(graph.batches)
        self.released = len(self.batches) if not loop else 1 + 3 * loss_lag

    def submit_next(self) -> list[int]:
        """The next batch submitted: the resources to start from."""
        last = self.batches.pop(0)
        self.released -= 1
        touched = _submit(self.graph, self.first, last, self.heaps, self.unmet)
        self.first = last
        return touched

    def finish_wave(self, loss_of: bytearray, losses_left: list[int]) -> list[int]:
        """The tasks ending at the next instant, done together: the resources to start from."""
        graph, unmet, heaps = self.graph, self.unmet, self.heaps
        if not self.wave:
            self.now = self.timed[0][0]
            while self.timed and self.timed[0][0] == self.now:
                self.wave.append(heapq.heappop(self.timed)[1])
        touched = []
        for task in self.wave:
            r = graph.res[task]
            self.free[r] = True
            touched.append(r)
            if loss_of[task]:
                it = loss_of[task] - 1
                losses_left[it] -= 1
                if not losses_left[it]:
                    self.released += 2  # lag 0: its step and the next graph; lag 1: graph t + 2, its step
            for dep in graph.dependents[task]:
                left = unmet[dep] - 1
                unmet[dep] = left
                if not left and dep < self.first:  # a later batch's task waits for its submission
                    r = graph.res[dep]
                    heapq.heappush(heaps[r], graph.rank[dep])
                    touched.append(r)
        self.done += len(self.wave)
        self.wave = []
        return touched

    def start_ready(self, touched: list[int], flags: bytearray, beyond: int) -> bool:
        """Each free resource of ``touched`` starts its most urgent ready task; whether a flagged
        task started."""
        graph, now, stopped = self.graph, self.now, False
        for r in touched:
            if self.free[r] and self.heaps[r]:
                task = heapq.heappop(self.heaps[r]) % graph.seq
                self.free[r] = False
                self.start[task] = now
                if task >= beyond and self.earliest < 0.0:
                    self.earliest = now
                stopped = stopped or bool(flags[task])
                end = now + graph.dur[task]
                if end == now:
                    self.wave.append(task)
                else:
                    heapq.heappush(self.timed, (end, task))
        return stopped


def _replay(
    graph: ReplayGraph,
    flags: bytearray,
    loop: bool,
    loss_lag: int,
    loss_of: bytearray,
    losses_left: list[int],
    beyond: int,
) -> tuple[list[float], int, float]:
    """`replay_run`'s loop: the start times, how many tasks never ran (0 when it stopped at a
    flagged task), and the first start of a task numbered ``beyond`` or more (-1: none)."""
    state = _Replay(graph, loop, loss_lag)
    submitting = False
    while True:
        if state.batches and state.released and (submitting or not state.wave):
            # Submission, batch by batch (idle resources start after each, before anything ends):
            # chained, all at time 0; a loop's, once the instant its losses came in at is over.
            touched = state.submit_next()
            submitting = bool(state.released and state.batches)
        elif state.wave or state.timed:
            touched = state.finish_wave(loss_of, losses_left)
        else:
            break
        if state.start_ready(touched, flags, beyond):
            return state.start, 0, state.earliest
    return state.start, len(graph.res) - state.done, state.earliest


def _submit(graph: ReplayGraph, first: int, last: int, heaps: list[list[int]], unmet: list[int]) -> list[int]:
    """Tasks ``first..last-1`` submitted: those with nothing unmet go on their resource's heap;
    returns the resources to start from (in the engine, after the whole batch is pushed)."""
    res, rank = graph.res, graph.rank
    touched = []
    for task in range(first, last):
        if not unmet[task]:
            heapq.heappush(heaps[res[task]], rank[task])
            touched.append(res[task])
    return touched
