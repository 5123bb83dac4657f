"""Plan evaluation without the engine: the same task graph and the same start rule, on integers.

Why: `choose_plan` times its candidates by running the real engine on the fake backend
(`roundpipe.planning.ranking`). At 94 layers one evaluation runs ~7000 tasks and costs 65-100 ms, half
of it building `Task` objects, the rest the engine's bookkeeping around them. The evaluator only
reads a few compute start times, so this module builds the graph `GraphBuilder` would build for
the evaluator's configuration (free transfers, free optimizer, no chunking, no grad-norm barrier,
no ordered steps, no async warm-up), as flat lists of task numbers, and replays the engine's start
rule on it:

- a task is ready once every dependency is done; each resource (a device's compute lane, its
  host-to-device link shared by act_up, grad_up and param_up, its device-to-host link shared by
  act_down and grad_down, and the host optimizer lane, as the fake backend with shared links
  groups them) runs one task at a time, and starts the ready task of highest priority, then the
  oldest (submission order);
- tasks of zero duration end at the instant they start; completions at one instant are taken in
  *waves*: the engine holds every start while another task ends at the same instant, so a free
  resource picks its next task only once the whole wave has released its dependents. Within a
  wave, the order of completions changes only the numbering of the next starts, never which task
  a resource picks, so waves are replayed as sets;
- the graphs are submitted in the order `roundpipe.planning.simulate.run_fake` submits them (per
  iteration its graph, then its optimizer step), idle resources starting after each batch: all
  at time 0 (a chained run), or as a training loop does (``after_loss``): iteration t's step and
  iteration t + 1's graph once iteration t's losses are in and the instant they came in at is
  over, which is when a virtual `Engine.wait` returns. A task of a batch not yet submitted
  waits for it, however early its dependencies end.

So a compute task starts here exactly when it starts in the engine. `tests/test_plan_replay.py`
checks the graph task for task against `GraphBuilder` (resources, priorities, dependencies,
durations) and the iteration times against the engine on sync and async shapes of every dispatch
kind. Anything outside that configuration (transfer or optimizer costs, memory budgets) must go
to the engine: this module has no notion of bytes. It never imports the scheduler or torch.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from roundpipe.plan import native
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import busiest_device_ms
from roundpipe.plan.partition import Plan
from roundpipe.plan.shape import RunShape
from roundpipe.planning.replay_graph import ReplayGraph, build_graph
from roundpipe.planning.replay_rule import replay_run, replay_starts

SETTLE_SHORT, SETTLE_LONG = 6, 20
"""A loop's settled time per iteration (`settled_ms`): a run of SETTLE_SHORT iterations, and one
of SETTLE_LONG where the short one has not settled."""
SHORT_REPEATS = 3
"""The short run has settled when its last SHORT_REPEATS gaps between iterations are equal."""
TAIL_GAPS = 12
"""The long run's figure: the mean of its last TAIL_GAPS gaps, a multiple of the cycles that
runs settle into (1 to 4 iterations, as a plan's slots come back to device 0 only every few
iterations, and 6)."""


def replay_iteration_ms(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    window: tuple[int, int] | None = None,
    loop: bool = True,
    loss_lag: int = 0,
) -> float:
    """What `roundpipe.planning.ranking.engine_evaluator` returns for ``plan``: sync, the makespan of one
    iteration; async, submitted as a training loop submits them (``loop``, reading each loss
    ``loss_lag`` iterations late), the settled time per iteration (`loop_iteration_ms`), or with a
    ``window`` (chained runs: (1, 5) by default) the time per iteration between the first
    computes of its two iterations of a run of ``window[1] + 1``."""
    if not async_optimizer:
        graph = build_graph(plan, costs, num_devices, num_microbatches, 1, False, round_size)
        starts = replay_starts(graph)
        kernels = native.kernels()
        if kernels is not None and starts:
            return kernels.span(starts, graph.packed()[2])  # type: ignore[no-any-return]
        ends = [s + d for s, d in zip(starts, graph.dur, strict=True)]
        return max(ends) - min(starts) if ends else 0.0
    return loop_iteration_ms(
        plan,
        costs,
        num_devices,
        num_microbatches,
        (loss_lag,),
        round_size=round_size,
        window=window,
        loop=loop,
    )[0]


def loop_iteration_ms(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    loss_lags: tuple[int, ...],
    *,
    round_size: int | None = None,
    window: tuple[int, int] | None = None,
    loop: bool = True,
    long_first: bool = False,
) -> list[float]:
    """Async `replay_iteration_ms` for each of ``loss_lags``, from one graph per run length
    (building one costs about what a replay does: `roundpipe.planning.ranking.choose_evaluated_plan`
    times both submissions). ``long_first``: for plans whose short run seldom settles, build
    and replay the long run at once and read the short one from it (`_loop_runs`).

    A loop's figure (``loop`` and no ``window``) is the time per iteration the run settles at,
    which is what a long training run gets: the gap between consecutive iterations' first
    computes once it repeats (SETTLE_SHORT iterations, SETTLE_LONG where those
    have not settled: `settled_ms`), and never under `busiest_device_ms`. The first few iterations can be
    faster or slower than that by 10-40%: a device round-robin gives more than its share builds
    its backlog over tens of iterations, and a loop one loss late settles only after a few
    iterations (docs/performance.md, "Settled iterations"), so a fixed window misjudges them."""
    if window is not None or not loop:
        first, last = window if window is not None else CHAINED_WINDOW
        graph = _graph(plan, costs, RunShape(num_devices, num_microbatches, True, round_size), last + 1)
        times = []
        for loss_lag in loss_lags:
            at = _first_computes(graph, last + 1, loop, loss_lag)
            times.append((at[last] - at[first]) / (last - first))
        return times
    shape = RunShape(num_devices, num_microbatches, True, round_size)
    floor, runs = _loop_runs(plan, costs, shape, long_first, loss_lags)
    return [settled_ms(runs(loss_lag), floor) for loss_lag in loss_lags]


def settled_ms(first_computes: Callable[[int], Sequence[float]], floor: float) -> float:
    """A loop's settled time per iteration (`loop_iteration_ms`) from ``first_computes(k)``, each
    iteration's first compute start in a run of k iterations, and the busiest device's time per
    iteration (``floor``): the last gap of SETTLE_SHORT iterations where their last SHORT_REPEATS
    gaps are equal, else the mean of the last TAIL_GAPS gaps of SETTLE_LONG iterations; never
    under ``floor``. The engine's evaluation (`roundpipe.planning.ranking`) shares it.

    Why these lengths: against runs of 40 iterations on the 24- and 28-layer grid shapes at
    (8, 16), every even plan and both loops, a long run of 20 is within 1% on 98% of the plans
    within 5% of each shape's best (16 iterations: 92%), and the fastest plan by it is within
    1.3% of the fastest by the 40 (docs/performance.md, "Settled iterations")."""
    ms, settled = short_estimate(first_computes, floor)
    if settled:
        return ms
    starts = first_computes(SETTLE_LONG)
    return max((starts[-1] - starts[-1 - TAIL_GAPS]) / TAIL_GAPS, floor)


def short_estimate(first_computes: Callable[[int], Sequence[float]], floor: float) -> tuple[float, bool]:
    """`settled_ms` from its short run alone: (its figure, True) where the SETTLE_SHORT iterations
    have settled; else (the mean of their last SHORT_REPEATS gaps, never under ``floor``, False),
    an estimate to rank plans by (off by up to tens of percent where a backlog builds), not a
    figure. The short run is most of a settled evaluation's cost only where it settles."""
    starts = first_computes(SETTLE_SHORT)
    gaps = [b - a for a, b in itertools.pairwise(starts)][-SHORT_REPEATS:]
    tolerance = 1e-9 * max(map(abs, gaps), default=0.0)
    if len(gaps) == SHORT_REPEATS and max(gaps) - min(gaps) <= tolerance:
        return max(gaps[-1], floor), True
    return max(math.fsum(gaps) / max(len(gaps), 1), floor), False


def loop_estimates(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    loss_lags: tuple[int, ...],
    *,
    round_size: int | None = None,
) -> list[tuple[float, bool]]:
    """`short_estimate` of a loop's settled time (`loop_iteration_ms`) for each of ``loss_lags``,
    from one graph of SETTLE_SHORT iterations."""
    floor, runs = _loop_runs(plan, costs, RunShape(num_devices, num_microbatches, True, round_size))
    return [short_estimate(runs(loss_lag), floor) for loss_lag in loss_lags]


def _loop_runs(
    plan: Plan,
    costs: LayerCosts,
    shape: RunShape,
    long_first: bool = False,
    lags: tuple[int, ...] = (),
) -> tuple[float, Callable[[int], Callable[[int], list[float]]]]:
    """A loop's floor (`busiest_device_ms`) and, per loss lag, ``first_computes(k)``: each
    iteration's first compute start in a run of k iterations, one graph per run length, built
    when first asked for and shared by the loss lags.

    ``long_first``: asked for the short run (SETTLE_SHORT), replay the long one (SETTLE_LONG) to
    its end and read the short run's figures from it, where they are the same: the long graph
    holds the short one's tasks in the same order (and the gradient tasks of its last iteration,
    which wait for that iteration's computes), then the batches after it. Those are submitted
    once earlier losses are in, and where none of their tasks starts until the short run's last
    first compute has, nothing before it can differ (a task that is ready but does not start
    changes no other start); else (a loop one loss late can let the next iteration in that
    early) the short graph is built and replayed. A loop one loss late has to run the long run
    on most plans (93 of 105 evaluations over the 16 grid shapes of 94 layers at (8, 16)),
    and this spares it the short graph and both short replays.

    ``lags``: the loss lags that will be asked for. With ``long_first``, within `side_by_side()`,
    the first ask starts the other lags' long replays on its worker thread, which the compiled
    replay runs without the GIL, beside its own; each lag's figures are the same as one by one."""
    floor = busiest_device_ms(plan, shape.num_microbatches, shape.num_devices, round_size=shape.round_size)
    return floor, _LoopRuns(plan, costs, shape, long_first, lags).runs


class _LoopRuns:
    """`_loop_runs`' graphs (one per run length, built when first asked for) and the long runs
    started on the side-by-side worker, shared by the loss lags of one plan."""

    def __init__(
        self, plan: Plan, costs: LayerCosts, shape: RunShape, long_first: bool, lags: tuple[int, ...]
    ) -> None:
        self.plan, self.costs, self.shape = plan, costs, shape
        self.long_first, self.lags = long_first, lags
        self.graphs: dict[int, ReplayGraph] = {}
        self.pending: dict[int, Future[tuple[list[float], float]]] = {}
        self.started = False  # the other lags' long replays, on the worker

    def graph_of(self, iterations: int) -> ReplayGraph:
        if iterations not in self.graphs:
            self.graphs[iterations] = _graph(self.plan, self.costs, self.shape, iterations)
        return self.graphs[iterations]

    def long_run(self, loss_lag: int) -> tuple[list[float], float]:
        if loss_lag in self.pending:
            return self.pending.pop(loss_lag).result()
        graph = self.graph_of(SETTLE_LONG)
        pool = getattr(_side, "pool", None)
        if not self.started and pool is not None:
            for other in dict.fromkeys(self.lags):
                if other != loss_lag:
                    self.pending[other] = pool.submit(_long_run, graph, other)
        self.started = True
        return _long_run(graph, loss_lag)

    def runs(self, loss_lag: int) -> Callable[[int], list[float]]:
        read: dict[int, list[float]] = {}  # first computes by run length

        def first_computes(iterations: int) -> list[float]:
            if iterations not in read and self.long_first and iterations == SETTLE_SHORT < SETTLE_LONG:
                starts, earliest = self.long_run(loss_lag)
                read[SETTLE_LONG] = starts
                if earliest < 0.0 or earliest > starts[SETTLE_SHORT - 1]:
                    read[SETTLE_SHORT] = starts[:SETTLE_SHORT]
            if iterations not in read:
                read[iterations] = _first_computes(self.graph_of(iterations), iterations, True, loss_lag)
            return read[iterations]

        return first_computes


def _long_run(graph: ReplayGraph, loss_lag: int) -> tuple[list[float], float]:
    """A loop's long run (SETTLE_LONG iterations) on ``graph``: each iteration's first compute, and
    the earliest start past the batches of the short run (`_loop_runs`): where the short graph's
    batches end, its last iteration's graph (no step after it)."""
    beyond = graph.batches[2 * SETTLE_SHORT - 2]
    return _run_first_computes(graph, SETTLE_LONG, True, loss_lag, beyond)


_side = threading.local()  # per planning thread: the worker of its open `side_by_side`, if any


@contextmanager
def side_by_side() -> Iterator[None]:
    """Within it, this thread's late-loop evaluations replay their second submission on a worker
    thread (`_loop_runs`), which the compiled replay runs without the GIL, beside the first; the
    figures are the same as one by one. The worker is this block's: it starts here and is joined
    on the way out (a pipe leaves no thread behind), and the compiled replay's working blocks are
    the thread's own, freed as it ends. Without the compiled loops (all Python, GIL-bound) it does
    nothing. `roundpipe.planning.ranking.choose_evaluated_plan` opens one around a late loop's choice."""
    if native.kernels() is None or getattr(_side, "pool", None) is not None:
        yield
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="roundpipe-replay")
    _side.pool = pool
    try:
        yield
    finally:
        _side.pool = None
        pool.shutdown(wait=True)


def _forget_side_by_side() -> None:
    """In a forked child: a worker the parent had open is not there (and one counted but absent
    would never start: the replays would wait forever), so the child replays one by one."""
    global _side
    _side = threading.local()


os.register_at_fork(after_in_child=_forget_side_by_side)


CHAINED_WINDOW = (1, 5)
"""A chained run's window (``loop=False``, what the ranking models are checked against): the time
per iteration between the first computes of iterations 1 and 5 of 6."""


def _graph(plan: Plan, costs: LayerCosts, shape: RunShape, iterations: int) -> ReplayGraph:
    """The async graph of ``iterations`` iterations of ``plan`` (`build_graph`)."""
    return build_graph(
        plan, costs, shape.num_devices, shape.num_microbatches, iterations, True, shape.round_size
    )


def _first_computes(graph: ReplayGraph, iterations: int, loop: bool, loss_lag: int) -> list[float]:
    """The first compute start of each of the first ``iterations`` iterations, replayed until the
    last of them starts its first compute."""
    return _run_first_computes(graph, iterations, loop, loss_lag)[0]


def _run_first_computes(
    graph: ReplayGraph, iterations: int, loop: bool, loss_lag: int, beyond: int | None = None
) -> tuple[list[float], float]:
    """`_first_computes`, and the earliest start of a task numbered ``beyond`` or more
    (`replay_run`)."""
    stop = bytearray(len(graph.res))
    for task in graph.computes[iterations - 1]:
        stop[task] = 1
    starts, earliest = replay_run(graph, stop, loop=loop, loss_lag=loss_lag, beyond=beyond)
    kernels = native.kernels()
    if kernels is not None and graph.packed_computes is not None:
        return kernels.first_starts(starts, *graph.packed_computes, iterations), earliest
    firsts = [min(starts[t] for t in graph.computes[i] if starts[t] >= 0.0) for i in range(iterations)]
    return firsts, earliest


__all__ = [
    "loop_estimates",
    "loop_iteration_ms",
    "replay_iteration_ms",
    "replay_starts",
    "settled_ms",
    "short_estimate",
]
