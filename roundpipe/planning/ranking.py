"""Plan evaluation by the real engine: iteration time of a plan on the fake backend, same costs.

The planner's objectives (t_max, the steady-state model) are proxies; where they disagree with
what the engine does, the engine is right. `engine_evaluator` gives `choose_plan` an exact
evaluation: it builds the graphs the training path builds, for whatever plan it is given, runs
them through the engine under a virtual clock and returns the iteration time in milliseconds.
Synchronous runs: the makespan of one iteration (fill and drain included). Asynchronous runs: the
time per iteration that a run settles at (the gap between consecutive iterations' first computes
once it repeats, never under the busiest device's share: `roundpipe.planning.replay.settled_ms`),
submitted as a training loop submits it: `RoundPipe.forward_backward` returns, and the loop calls
`step()` and submits the next iteration, once the fused stage's losses are in. The settled time,
not a fixed window of the first iterations: those run up to 10-40% faster or slower than a long
run does (docs/performance.md, "Settled iterations"). A *chained* run
(every iteration submitted at once, ``loop=False``) lends an iteration's idle devices to the
next one, which a loop cannot: a fused-only plan of 4 devices x 8 microbatches runs its two
rounds on two of them, and judged chained it looked twice as fast as it runs
(docs/performance.md, "Async plans judged as a training loop runs them").
It lives outside ``plan`` because it runs the scheduler; ``plan`` must stay pure. It must never
touch a device or sleep.

By default the evaluator does not run the engine itself but `roundpipe.planning.replay`: the same
graph as flat lists and the engine's start rule, which gives the same iteration times (checked
task for task and time for time in `tests/test_plan_replay.py`) four to eight times faster. It
applies because evaluation runs with free transfers and a free optimizer; ``engine=True`` runs the
engine (the tests compare the two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from roundpipe.plan._collector import collections_paused
from roundpipe.plan.choose import choose_plan
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import busiest_device_ms
from roundpipe.plan.partition import Plan
from roundpipe.plan.shape import RunShape
from roundpipe.planning.replay import (
    CHAINED_WINDOW,
    loop_estimates,
    loop_iteration_ms,
    replay_iteration_ms,
    settled_ms,
    short_estimate,
    side_by_side,
)
from roundpipe.planning.simulate import SimulationResult, run_fake

STEADY_WINDOW = CHAINED_WINDOW
"""A chained async evaluation (and one given a window): time per iteration between the first
computes of iterations 1 and 5 (0-based) of a run of 6; iteration 0 fills the pipeline. A
training loop's evaluation reads the time it settles at instead (`engine_evaluator`)."""


def iteration_starts(result: SimulationResult, iterations: int) -> list[float]:
    """The start of each iteration's first compute task, in ms."""
    starts = [float("inf")] * iterations
    for task in result.trace:
        if task.kind == "compute" and task.start_t < starts[task.iteration]:
            starts[task.iteration] = task.start_t
    return starts


def engine_evaluator(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    window: tuple[int, int] | None = None,
    engine: bool = False,
    loop: bool = True,
    loss_lag: int = 0,
) -> Callable[[Plan], float]:
    """``evaluate(plan) -> ms per iteration`` for `choose_plan`: the engine's figure on the fake
    backend, by `replay_iteration_ms` (or, with ``engine=True``, by running the engine). Async:
    as a training loop submits the iterations (the module docstring; ``loss_lag=1``: a loop that
    reads each loss one iteration late, `RoundPipe.forward_backward(..., wait=False)`), the time
    per iteration the loop settles at (`roundpipe.planning.replay.settled_ms`); with a ``window``,
    or chained (``loop=False``: what the ranking models are checked against), the time per
    iteration between the first computes of the window's two iterations (STEADY_WINDOW)."""
    if window is not None:
        first, last = window
        if not 0 <= first < last:
            raise ValueError(f"the steady window {window} must be two iterations, first < last")
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size, loss_lag)
    timing = _Timing(costs, shape, window, loop)
    if not (async_optimizer and loop and window is None):  # not a loop's settled time
        return timing.by_engine if engine else timing.by_replay
    floor = functools.partial(_busiest, shape)
    if engine:
        return EstimatingEvaluator(timing.by_engine, floor, timing.engine_estimate)
    return EstimatingEvaluator(timing.by_replay, floor, timing.replay_estimate)


@dataclass(frozen=True)
class _Timing:
    """`engine_evaluator`'s figures for one run shape: by the replay (`roundpipe.planning.replay`) or
    by the engine itself (`roundpipe.planning.simulate.run_fake`), which give the same times."""

    costs: LayerCosts
    shape: RunShape
    window: tuple[int, int] | None
    loop: bool

    def by_replay(self, plan: Plan) -> float:
        shape = self.shape
        with collections_paused():
            return replay_iteration_ms(
                plan,
                self.costs,
                shape.num_devices,
                shape.num_microbatches,
                async_optimizer=shape.async_optimizer,
                round_size=shape.round_size,
                window=self.window,
                loop=self.loop,
                loss_lag=shape.loss_lag,
            )

    def by_engine(self, plan: Plan) -> float:
        shape = self.shape
        if not shape.async_optimizer:
            _, trace, _ = run_fake(
                plan,
                self.costs,
                shape.num_devices,
                shape.num_microbatches,
                1,
                False,
                round_size=shape.round_size,
            )
            return trace.makespan_ms()
        if self.window is None and self.loop:
            return settled_ms(functools.partial(self.first_computes, plan), _busiest(shape, plan))
        first, last = self.window if self.window is not None else STEADY_WINDOW
        starts = self.first_computes(plan, last + 1)
        return (starts[last] - starts[first]) / (last - first)

    def first_computes(self, plan: Plan, iterations: int) -> list[float]:
        """The engine's start of each iteration's first compute, in a run of ``iterations``."""
        shape = self.shape
        run, _, computes = run_fake(
            plan,
            self.costs,
            shape.num_devices,
            shape.num_microbatches,
            iterations,
            True,
            round_size=shape.round_size,
            after_loss=self.loop,
            loss_lag=shape.loss_lag if self.loop else 0,
        )
        return [min(run.task(key).start_t for key in computes[i]) for i in range(iterations)]

    def replay_estimate(self, plan: Plan) -> tuple[float, bool]:
        shape = self.shape
        with collections_paused():
            [estimate] = loop_estimates(
                plan,
                self.costs,
                shape.num_devices,
                shape.num_microbatches,
                (shape.loss_lag,),
                round_size=shape.round_size,
            )
        return estimate

    def engine_estimate(self, plan: Plan) -> tuple[float, bool]:
        return short_estimate(functools.partial(self.first_computes, plan), _busiest(self.shape, plan))


class FlooredEvaluator:
    """``evaluate(plan)`` with ``floor(plan)``, a lower bound of it (`choose_plan` spares the
    plans whose floor is past the best time so far): a loop's settled time per iteration is never
    under the busiest device's (`busiest_device_ms`)."""

    def __init__(self, evaluate: Callable[[Plan], float], floor: Callable[[Plan], float]) -> None:
        self._evaluate = evaluate
        self._floor = floor

    def __call__(self, plan: Plan) -> float:
        return self._evaluate(plan)

    def floor(self, plan: Plan) -> float:
        return self._floor(plan)


class EstimatingEvaluator(FlooredEvaluator):
    """A `FlooredEvaluator` with ``estimate(plan)``: the figure of the evaluation's short run alone
    (`roundpipe.planning.replay.short_estimate`), ``(ms, True)`` where that is the evaluation's
    figure, ``(ms, False)`` where it is only an estimate (`choose_plan` looks at a shortlist of
    plans this way before it times them)."""

    def __init__(
        self,
        evaluate: Callable[[Plan], float],
        floor: Callable[[Plan], float],
        estimate: Callable[[Plan], tuple[float, bool]],
    ) -> None:
        super().__init__(evaluate, floor)
        self._estimate = estimate

    def estimate(self, plan: Plan) -> tuple[float, bool]:
        return self._estimate(plan)


def _busiest(shape: RunShape, plan: Plan) -> float:
    return busiest_device_ms(plan, shape.num_microbatches, shape.num_devices, round_size=shape.round_size)


def choose_evaluated_plan(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    mem_limit_bytes: int | None,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    loss_lag: int = 0,
) -> Plan:
    """`choose_plan` with the engine as its judge: the plan every caller of roundpipe runs, for a
    training loop that reads each loss ``loss_lag`` iterations late (`RunConfig.loss_lag`).

    A loop one iteration late submits iteration t + 1 while t computes, which is faster on most
    plans but not on all: on some, iteration t + 1's forward runs take devices that iteration t's
    backward needed, and waiting for t's losses first (what `submission_lag` then tells the pipe
    to do) is faster. So such a loop's plans are judged by the better of the two submissions.
    The candidates are the same for both loops (``choose_plan(..., loop=True)``); for the late
    loop the chained ranking's two best plans of up to N slots are timed as well (``late``)."""
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size, loss_lag)
    return choose_for_shape(costs, shape, mem_limit_bytes)


def choose_for_shape(costs: LayerCosts, shape: RunShape, mem_limit_bytes: int | None) -> Plan:
    """`choose_evaluated_plan` for a run of ``shape``."""
    late = bool(shape.loss_lag and shape.async_optimizer)
    evaluate: Callable[[Plan], float]
    if late:
        evaluate = _late_loop_evaluator(costs, shape)
    else:
        evaluate = engine_evaluator(
            costs,
            shape.num_devices,
            shape.num_microbatches,
            async_optimizer=shape.async_optimizer,
            round_size=shape.round_size,
        )
    with side_by_side() if late else nullcontext():
        return choose_plan(
            costs,
            shape.num_devices,
            shape.num_microbatches,
            mem_limit_bytes,
            async_optimizer=shape.async_optimizer,
            round_size=shape.round_size,
            evaluate=evaluate,
            late=late,
        )


def late_loop_evaluator(
    costs: LayerCosts, num_devices: int, num_microbatches: int, *, round_size: int | None = None
) -> Callable[[Plan], float]:
    """``evaluate(plan)`` for an async loop that reads each loss one iteration late: the better of
    submitting each iteration early and waiting for the previous one's losses, the latter being
    what the pipe does on such a plan (`submission_lag`)."""
    shape = RunShape(num_devices, num_microbatches, True, round_size, loss_lag=1)
    return _late_loop_evaluator(costs, shape)


def _late_loop_evaluator(costs: LayerCosts, shape: RunShape) -> EstimatingEvaluator:
    def evaluate(plan: Plan) -> float:
        return min(_both_submissions(plan, costs, shape))

    def estimate(plan: Plan) -> tuple[float, bool]:
        # the better submission's figure is exact only where both are (an estimate of the other
        # could be above or below its figure)
        with collections_paused():
            both = loop_estimates(
                plan, costs, shape.num_devices, shape.num_microbatches, (0, 1), round_size=shape.round_size
            )
        return min(ms for ms, _ in both), all(settled for _, settled in both)

    return EstimatingEvaluator(evaluate, functools.partial(_busiest, shape), estimate)


def submission_lag(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    loss_lag: int = 0,
) -> int:
    """How late the pipe should let a loop of ``loss_lag`` submit: ``loss_lag``, or 0 where the
    engine on the fake backend runs ``plan`` faster when each iteration's step (and so the next
    iteration) waits for its losses (`choose_evaluated_plan`). Ties keep the lag: on real devices
    submitting early also hides the host's time between iterations, which the fake engine does
    not model. Sync runs keep the lag (the next iteration waits for the step anyway)."""
    if not loss_lag or not async_optimizer:
        return loss_lag
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size, loss_lag)
    waiting, late = _both_submissions(plan, costs, shape)
    return 0 if waiting < late else loss_lag


def _both_submissions(plan: Plan, costs: LayerCosts, shape: RunShape) -> tuple[float, float]:
    """The loop's ms per iteration waiting for each loss and reading it one iteration late
    (`engine_evaluator` with ``loss_lag`` 0 and 1), replayed on one graph. Remembered for the
    last few plans: the pipe asks `submission_lag` of the plan `choose_evaluated_plan` has just
    timed this way (replays read the times only, not the bytes or names; nor the loss lag, which
    both submissions cover)."""
    return _submissions_of(
        plan, costs.fwd_ms, costs.bwd_ms, shape.num_devices, shape.num_microbatches, shape.round_size
    )


@functools.lru_cache(maxsize=64)
def _submissions_of(
    plan: Plan,
    fwd_ms: tuple[float, ...],
    bwd_ms: tuple[float, ...],
    num_devices: int,
    num_microbatches: int,
    round_size: int | None,
) -> tuple[float, float]:
    costs = _times_only(fwd_ms, bwd_ms)
    with collections_paused():
        waiting, late = loop_iteration_ms(
            plan, costs, num_devices, num_microbatches, (0, 1), round_size=round_size, long_first=True
        )
    return waiting, late


@functools.lru_cache(maxsize=8)
def _times_only(fwd_ms: tuple[float, ...], bwd_ms: tuple[float, ...]) -> LayerCosts:
    """The layer times as `LayerCosts` (no bytes), checked once per table, not once per plan."""
    return LayerCosts(fwd_ms, bwd_ms, (0,) * len(fwd_ms))
