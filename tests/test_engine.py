"""The engine on hand-made graphs: ordering, priorities, failures, stalls, cycles."""

from __future__ import annotations

import asyncio

import pytest

from roundpipe.backends.fake import FakeBackend
from roundpipe.errors import ScheduleError, TaskFailedError
from roundpipe.sched.engine import Engine
from roundpipe.sched.event_loop import run_sync
from roundpipe.sched.task import Task


def _task(name: str, lane: str = "d0.compute", deps: tuple[str, ...] = (), priority: int = 0) -> Task:
    return Task((name,), "compute", lane, deps=[(d,) for d in deps], priority=priority)


def _durations(**ms: float) -> FakeBackend:
    return FakeBackend(durations=lambda t: ms.get(t.key[0], 1.0))


def _run(engine: Engine, tasks: list[Task]) -> None:
    async def main() -> None:
        engine.submit(tasks)
        await engine.wait()

    run_sync(main())


def test_dependencies_and_lanes_give_exact_virtual_times() -> None:
    engine = Engine(_durations(a=2.0, b=3.0, c=1.0, d=1.0))
    tasks = [
        _task("a"),
        _task("b", lane="d1.compute"),
        _task("c", deps=("a", "b")),
        _task("d", deps=("a",)),
    ]
    _run(engine, tasks)
    times = {t.key[0]: (t.start_t, t.end_t) for t in engine.trace}
    assert times["a"] == (0.0, 2.0)
    assert times["b"] == (0.0, 3.0)
    assert times["d"] == (2.0, 3.0)  # ready at 2 on a free lane
    assert times["c"] == (3.0, 4.0)  # waits for b and for the lane
    assert len(engine.trace) == 4


def test_priority_then_submission_order_among_ready_tasks() -> None:
    engine = Engine(_durations())
    tasks = [
        _task("blocker"),
        _task("low", deps=("blocker",), priority=1),
        _task("high", deps=("blocker",), priority=5),
        _task("low2", deps=("blocker",), priority=1),
    ]
    _run(engine, tasks)
    assert [t.key[0] for t in engine.trace] == ["blocker", "high", "low", "low2"]


def test_dependency_on_a_task_submitted_later() -> None:
    engine = Engine(_durations())

    async def main() -> None:
        engine.submit([_task("late_dependent", deps=("early",))])
        engine.submit([_task("early", lane="d1.compute")])
        await engine.wait()

    run_sync(main())
    assert [t.key[0] for t in engine.trace] == ["early", "late_dependent"]


def test_cycle_is_named_and_engine_stays_usable() -> None:
    engine = Engine(_durations())
    with pytest.raises(ScheduleError, match=r"dependency cycle: compute .* -> compute"):
        engine.submit([_task("x", deps=("y",)), _task("y", deps=("x",))])
    _run(engine, [_task("ok")])
    assert [t.key[0] for t in engine.trace] == ["ok"]


def test_duplicate_key_rejected() -> None:
    engine = Engine(_durations())
    with pytest.raises(ScheduleError, match="duplicate task key"):
        engine.submit([_task("a"), _task("a")])


def test_stall_reports_unmet_dependencies() -> None:
    engine = Engine(_durations())
    with pytest.raises(ScheduleError, match=r"(?s)stalled.*waits for: \('ghost',\) \(never submitted\)"):
        _run(engine, [_task("a"), _task("b", deps=("a", "ghost"))])


def test_failure_stops_new_work_and_names_the_task() -> None:
    boom = RuntimeError("boom")
    backend = FakeBackend(durations=lambda t: 1.0, fail=lambda t: boom if t.key == ("b",) else None)
    engine = Engine(backend)
    tasks = [_task("a"), _task("b", deps=("a",)), _task("c", deps=("b",)), _task("side", lane="d1.compute")]
    with pytest.raises(TaskFailedError, match=r"task failed: compute .* RuntimeError: boom") as info:
        _run(engine, tasks)
    assert info.value.__cause__ is boom
    ran = {t.key[0] for t in engine.trace}
    assert "c" not in ran and "a" in ran
    assert engine.cancel_pending() == 2  # b (failed) and c
    _run(engine, [_task("again")])
    assert engine.trace[-1].key == ("again",)


def test_wait_for_some_keys_only() -> None:
    engine = Engine(_durations(slow=100.0))

    async def main() -> float:
        engine.submit([_task("fast"), _task("slow", lane="d1.compute")])
        await engine.wait([("fast",)])
        return engine.backend.now()

    assert run_sync(main()) == 1.0


def test_a_virtual_wait_returns_once_its_instant_is_over() -> None:
    """``first`` and ``tie`` end at 1 ms; ``low`` (ready at 0) and ``urgent`` (released by
    ``tie``) wait for one lane. A wait on ``first`` returns with ``tie`` done too, so what the
    waiter submits then finds ``urgent`` ready, and the lane goes to it, not to whatever the
    waiter's batch holds or ``low``; without it, which of ``tie``'s completion and the waiter
    came first would decide, by the order of equal end times."""
    engine = Engine(_durations())

    async def main() -> list[str]:
        engine.submit(
            [
                _task("first"),
                _task("tie", lane="d1.compute"),
                _task("urgent", lane="d2.compute", deps=("tie",), priority=5),
            ]
        )
        await engine.wait([("first",)])
        assert engine.backend.now() == 1.0
        assert engine.task(("tie",)).end_t == 1.0  # done before the waiter acts
        engine.submit([_task("late", lane="d2.compute", priority=1)])
        await engine.wait()
        return [t.key[0] for t in engine.trace if t.lane == "d2.compute"]

    assert run_sync(main()) == ["urgent", "late"]


def test_statistics_expose_counts() -> None:
    engine = Engine(_durations())
    _run(engine, [_task("a"), _task("b", deps=("a",))])
    stats = engine.statistics()
    assert (stats.submitted, stats.done, stats.running, stats.waiting, stats.failed) == (2, 2, 0, 0, 0)
    assert stats.now_ms == 2.0


async def test_engine_runs_on_the_callers_loop_and_yields() -> None:
    # 20k chained virtual tasks: other coroutines on the same loop still get turns.
    engine = Engine(FakeBackend(durations=lambda t: 1.0))
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beat = asyncio.ensure_future(heartbeat())
    engine.submit([_task(str(i), deps=(str(i - 1),) if i else ()) for i in range(20_000)])
    await engine.wait()
    beat.cancel()
    assert ticks >= 3
    assert engine.backend.now() == 20_000.0


def test_forget_drops_exactly_the_finished_tasks_the_horizon_calls_old() -> None:
    """Keys are forgotten by age (iteration or step) in one question per age; hand-written keys
    are asked one by one. What is dropped must be what asking about every key would drop, and a
    forgotten key still counts as done for a later dependency."""
    from roundpipe.retention import forget_horizon
    from roundpipe.sched.keys import ComputeKey, StepKey

    engine = Engine(FakeBackend(durations=lambda t: 1.0))
    tasks = [
        Task(ComputeKey(i, s, 0), "compute", "d0.compute", iteration=i) for i in range(6) for s in range(3)
    ]
    tasks += [Task(StepKey(step, 0), "step", "optimizer", step=step) for step in range(6)]
    tasks += [Task(("mine", n), "compute", "d0.compute") for n in range(2)]
    _run(engine, tasks)
    older = forget_horizon(oldest_iteration=4, next_step=5)  # iterations < 2 and steps < 2 are old
    expected_kept = {t.key for t in tasks if not older(t.key)}
    engine.forget(older)
    assert {t.key for t in tasks if engine.is_done(t.key)} == expected_kept
    assert len(expected_kept) == 4 * 3 + 4 + 2
    later = Task(("later",), "compute", "d0.compute", deps=[ComputeKey(0, 1, 0), ("mine", 1)])
    _run(engine, [later])  # one dependency forgotten, one kept: both done
    assert engine.is_done(("later",))
    engine.forget(forget_horizon(oldest_iteration=9, next_step=9))
    assert [t.key for t in tasks if engine.is_done(t.key)] == [("mine", 0), ("mine", 1)]  # never old
