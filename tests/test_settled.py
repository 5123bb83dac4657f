"""A training loop's plans are judged by the time per iteration its run settles at.

The first iterations of an async loop are not what a long run gets: a device round-robin gives a
little more than its share builds a backlog for tens of iterations before it sets the pace, and a
loop reading each loss one iteration late takes a few iterations to find its rhythm. The
evaluator (`roundpipe.planning.ranking.engine_evaluator`, `roundpipe.planning.replay.settled_ms`) reads the
gap between consecutive iterations once it repeats, never under the busiest device's time
(`busiest_device_ms`). These tests check it against long engine runs on the fake backend
(virtual clock), and check the parts on their own.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Callable

import pytest

from roundpipe.plan import LayerCosts, Plan, choose_plan, native
from roundpipe.plan._ranking import _stages
from roundpipe.plan.choose import _Timer, every_even_plan
from roundpipe.plan.dispatch import busiest_device_ms, busiest_device_share, dispatch
from roundpipe.plan.rounds import round_sizes
from roundpipe.planning import replay as replay_module
from roundpipe.planning.ranking import (
    FlooredEvaluator,
    choose_evaluated_plan,
    engine_evaluator,
    iteration_starts,
    late_loop_evaluator,
)
from roundpipe.planning.replay import (
    SETTLE_LONG,
    SETTLE_SHORT,
    TAIL_GAPS,
    loop_iteration_ms,
    settled_ms,
    side_by_side,
)
from roundpipe.planning.replay_graph import ReplayGraph
from roundpipe.planning.simulate import simulate
from tests.test_plan_choice import grid_costs


def even_plan(costs: LayerCosts, slots: int, fused_start: int, forward_stages: int) -> Plan:
    """The even plan of ``every_even_plan`` with these slots, fused start and forward stages."""
    for plan in every_even_plan(costs, 8, 16):
        if (plan.num_slots, plan.fused.start, len(plan.fwd_stages)) == (slots, fused_start, forward_stages):
            return plan
    raise AssertionError(
        f"no even plan of {slots} slots, fused stage at {fused_start}, {forward_stages} forward"
    )


def engine_gaps(plan: Plan, costs: LayerCosts, iterations: int, loss_lag: int = 0) -> list[float]:
    """Gaps between consecutive iterations' first computes of a loop run on the engine."""
    run = simulate(plan, costs, 8, 16, iterations, True, after_loss=True, loss_lag=loss_lag)
    starts = iteration_starts(run, iterations)
    return [b - a for a, b in itertools.pairwise(starts)]


def runs_of(gaps: list[float]) -> Callable[[int], list[float]]:
    """``first_computes(k)`` of a run whose iterations are ``gaps`` apart (a FakeRun's starts)."""

    def first_computes(iterations: int) -> list[float]:
        starts = [0.0]
        for gap in gaps[: iterations - 1]:
            starts.append(starts[-1] + gap)
        return starts

    return first_computes


def test_settled_ms_reads_the_short_run_once_its_gaps_repeat() -> None:
    assert settled_ms(runs_of([9.0, 7.0, 5.0, 5.0, 5.0] + [1.0] * 20), floor=0.0) == 5.0
    assert settled_ms(runs_of([9.0, 7.0, 5.0, 5.0, 5.0] + [1.0] * 20), floor=6.0) == 6.0


def test_settled_ms_reads_a_long_runs_cycles_whole() -> None:
    """A run alternating 3, 3, 6 (a cycle of three) is not settled after 6 iterations; the long
    run's last 12 gaps hold four whole cycles: 4.0 per iteration, not the last gap or two."""
    cycle = [3.0, 3.0, 6.0]
    assert settled_ms(runs_of([1.0, 2.0] + cycle * 8), floor=0.0) == pytest.approx(4.0)
    two = [2.0, 5.0]  # gaps 2, 5, 2, 5 ...: 3.5
    assert settled_ms(runs_of([8.0] + two * 12), floor=0.0) == pytest.approx(3.5)
    assert SETTLE_LONG - 1 - TAIL_GAPS >= 3  # the long run's figure leaves out its first gaps


def test_busiest_device_is_dispatchs_load() -> None:
    """`busiest_device_ms` adds up what `dispatch` gives each device over the iterations after
    which it comes back to device 0."""
    costs = grid_costs(12, 2.0, 3.0)
    for plan in every_even_plan(costs, 8, 16)[::11]:
        load = [0.0] * 8
        first, iterations = 0, 0
        while True:
            runs, first = dispatch(plan, 16, 8, first_device=first)
            for run in runs:
                load[run.device] += plan.slot_ms[run.slot.index] * len(run.microbatches)
            iterations += 1
            if first == 0:
                break
        assert busiest_device_ms(plan, 16, 8) == pytest.approx(max(load) / iterations, rel=1e-12)
        assert busiest_device_share(plan.slot_ms, 8, round_sizes(16, 8)) == busiest_device_ms(plan, 16, 8)


def test_the_first_iterations_run_faster_than_the_loop_settles_at() -> None:
    """24 layers, backward 2x, head 3x: a 4-slot plan (fused stage of the last 4 layers and the
    head) runs its first iterations 188 ms apart, then 240.24 ms apart for good. The evaluator
    gave 206.0 ms (iterations 1-5); it now gives the settled 240.24 ms, the engine's figure over
    iterations 12-24, and the engine path gives the same as the replay."""
    costs = grid_costs(24, 2.0, 3.0)
    plan = even_plan(costs, 4, 21, 1)
    gaps = engine_gaps(plan, costs, 24)
    assert gaps[0] == pytest.approx(188.01, abs=0.01)
    assert gaps[-12:] == pytest.approx([240.24] * 12, abs=0.01)
    replay = engine_evaluator(costs, 8, 16, async_optimizer=True)
    engine = engine_evaluator(costs, 8, 16, async_optimizer=True, engine=True)
    assert replay(plan) == pytest.approx(240.24, abs=0.01)
    assert engine(plan) == replay(plan)
    windowed = engine_evaluator(costs, 8, 16, async_optimizer=True, window=(1, 5))
    assert windowed(plan) == pytest.approx(sum(gaps[1:5]) / 4)  # the window it used to read


def test_a_busy_device_sets_the_pace_after_many_iterations() -> None:
    """24 layers, backward 2x, head 3x, a loop one loss late: an 8-slot plan runs 17 iterations
    320.2 ms apart while the device round-robin gives the fused stage builds its backlog; from
    then on it takes 336.0 ms, that device's time per iteration. The evaluator reads 336.0 (its
    replays are 20 iterations long: the floor brings what they cannot see)."""
    costs = grid_costs(24, 2.0, 3.0)
    plan = even_plan(costs, 8, 21, 1)
    gaps = engine_gaps(plan, costs, 24, loss_lag=1)
    assert gaps[5:15] == pytest.approx([320.16] * 10, abs=0.01)
    assert gaps[-4:] == pytest.approx([336.0] * 4, abs=0.01)
    assert busiest_device_ms(plan, 16, 8) == pytest.approx(336.0, abs=0.01)
    late = late_loop_evaluator(costs, 8, 16)
    assert late(plan) == pytest.approx(336.0, abs=0.01)


@pytest.mark.parametrize("loss_lag", [0, 1])
def test_settled_figures_match_long_engine_runs(loss_lag: int) -> None:
    """On every 25th even plan of a grid shape the evaluator gives what 40 engine iterations
    settle at (the mean gap over the last 12, a multiple of every cycle seen), or the busiest
    device's time where that is more (a backlog still building at iteration 40). Not always
    exact: a loop one loss late can take more than 20 iterations to settle (on 16 layers,
    backward 2.5x, head 2x, one of every 40th plan's 11 reads 0.46% over)."""
    costs = grid_costs(12, 2.5, 2.0)
    evaluate = engine_evaluator(costs, 8, 16, async_optimizer=True, loss_lag=loss_lag)
    plans = every_even_plan(costs, 8, 16)[::25]
    assert len(plans) == 10
    for plan in plans:
        gaps = engine_gaps(plan, costs, 40, loss_lag)
        settled = max(sum(gaps[-12:]) / 12, busiest_device_ms(plan, 16, 8))
        assert evaluate(plan) == pytest.approx(settled, rel=1e-9), plan


def test_floored_plans_are_spared_without_changing_the_choice() -> None:
    """`choose_plan` does not time a plan whose busiest device is past the best time so far: the
    same plan is chosen with and without the floor, with fewer evaluations."""
    costs = grid_costs(24, 2.5, 2.0)
    late = late_loop_evaluator(costs, 8, 16)
    calls: list[Plan] = []

    def counted(plan: Plan) -> float:
        calls.append(plan)
        return late(plan)

    floored = choose_plan(
        costs, 8, 16, async_optimizer=True, evaluate=FlooredEvaluator(counted, late.floor), late=True
    )
    with_floor = len(calls)
    calls.clear()
    plain = choose_plan(costs, 8, 16, async_optimizer=True, evaluate=counted, late=True)
    assert floored == plain
    assert with_floor < len(calls)
    timer = _Timer(FlooredEvaluator(late, late.floor))
    plans = {key: plan for plan in every_even_plan(costs, 8, 16)[::25] for key in [_stages(plan)]}
    for plan in plans.values():
        timer.time(plan)
    assert timer.spared
    best_ms = min(ms for ms, _ in timer.timed.values())
    for key in timer.spared:  # each spared plan is slower than the best timed one
        assert late(plans[key]) > best_ms


def test_the_short_run_read_from_the_long_one_gives_the_same_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """`loop_iteration_ms(..., long_first=True)` (the late loop's evaluation) reads the short run
    from the long one where the batches after it started nothing in time, else replays the short
    graph: the same figures both ways, on plans of every size, both loss lags, and both branches
    taken (a loop one loss late lets an iteration in early enough on some plans)."""
    shorts: list[int] = []
    replay_short = replay_module._first_computes

    def counted(graph: ReplayGraph, iterations: int, loop: bool, loss_lag: int) -> list[float]:
        shorts.append(iterations)
        return replay_short(graph, iterations, loop, loss_lag)

    monkeypatch.setattr(replay_module, "_first_computes", counted)
    read = replayed = 0
    for layers, ratio, head in ((24, 1.3, 1.0), (24, 2.5, 4.0), (28, 3.8, 2.0)):
        costs = grid_costs(layers, ratio, head)
        for plan in every_even_plan(costs, 8, 16)[::9]:
            expected = loop_iteration_ms(plan, costs, 8, 16, (0, 1))
            shorts.clear()
            assert loop_iteration_ms(plan, costs, 8, 16, (0, 1), long_first=True) == expected, plan
            replayed += SETTLE_SHORT in shorts
            read += SETTLE_SHORT not in shorts
            with side_by_side():  # the second submission's replays on the worker thread
                assert loop_iteration_ms(plan, costs, 8, 16, (0, 1), long_first=True) == expected, plan
    assert read > 10 * replayed > 0, (read, replayed)


def test_the_late_loop_choice_leaves_no_thread_behind() -> None:
    """`choose_evaluated_plan` for a loop one loss late replays side by side on a worker thread of
    its own (`roundpipe.planning.replay.side_by_side`), joined before it returns: the same plan as one by one,
    and no thread left (a closed pipe leaves none)."""
    costs = grid_costs(24, 3.8, 2.0)
    before = {t.name for t in threading.enumerate()}
    seen: list[str] = []
    run_long = replay_module._long_run

    def watched(graph: ReplayGraph, loss_lag: int) -> tuple[list[float], float]:
        seen.append(threading.current_thread().name)
        return run_long(graph, loss_lag)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "_long_run", watched)
        plan = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert {t.name for t in threading.enumerate()} - before == set()
    if native.built():
        assert any(name.startswith("roundpipe-replay") for name in seen)
    with native.pure_python():  # no worker: one by one
        assert choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1) == plan


# The fork is the point: the parent has the worker thread running (Python 3.12 warns of it).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_inside_side_by_side_replays_one_by_one() -> None:
    """Within `roundpipe.planning.replay.side_by_side` the late loop's second replay runs on a worker thread. A
    child forked there has no such thread: it replays one by one instead of waiting forever for
    the parent's."""
    costs = grid_costs(24, 2.5, 4.0)
    plan = every_even_plan(costs, 8, 16)[100]
    expected = loop_iteration_ms(plan, costs, 8, 16, (0, 1), long_first=True)
    with side_by_side():
        assert loop_iteration_ms(plan, costs, 8, 16, (0, 1), long_first=True) == expected
        pid = os.fork()
        if pid == 0:  # the child: the same figures, or exit 1; never return into pytest
            try:
                os._exit(
                    0 if loop_iteration_ms(plan, costs, 8, 16, (0, 1), long_first=True) == expected else 1
                )
            finally:
                os._exit(2)

    def too_long(*_: object) -> None:
        raise TimeoutError

    before = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    try:
        _, status = os.waitpid(pid, 0)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's late-loop replay did not finish in 60 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert os.waitstatus_to_exitcode(status) == 0
