"""Schedule properties of the real engine + real task graphs on the fake backend, over random runs.

Hypothesis draws layer costs, plans (from `partition` or hand-made with `Plan.from_stages`),
1-8 devices, 1-32 microbatches, 1-3 iterations, sync/async, with and without link bandwidth,
parameter/activation bytes, upload chunking, a shared link, round sizes and a random
`Perturbation` (delays and jitter per task kind). On every resulting trace we check what the
design promises: each task runs once, lanes and resources run one task at a time, dependencies and
the five rules hold, the most urgent ready task starts first, nothing is left waiting, microbatch
order, one-stage prefetch, one-microbatch activation lookahead, and round-robin placement.
(tests/test_rule_checker.py tests the rule checker itself on tampered traces.)
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence

from hypothesis import given

from roundpipe.backends.fake import FakeBackend
from roundpipe.plan import dispatch
from roundpipe.planning.simulate import SimulationResult
from roundpipe.sched import rules
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    G_COPY,
    GRAD_DOWN,
    P_COPY,
    PARAM_UP,
    STEP,
    Task,
)
from roundpipe.sched.trace import Trace
from tests.scenarios import PROPERTY_SETTINGS, Scenario, scenarios

# --------------------------------------------------------------------- property checks


def _expected_keys(sc: Scenario) -> Counter:
    builder = sc.builder()
    keys: Counter = Counter()
    for it in range(sc.iterations):
        keys.update(t.key for t in builder.forward_backward(it, it, sc.num_microbatches).tasks)
        keys.update(t.key for t in builder.optimizer_step(it))
    return keys


def _check_runs_once(sc: Scenario, result: SimulationResult) -> None:
    trace = result.trace
    got = Counter(t.key for t in trace)
    assert max(got.values()) == 1, [k for k, c in got.items() if c > 1][:5]
    expected = _expected_keys(sc)
    assert got == expected, (
        f"missing {list((expected - got).keys())[:5]}, unexpected {list((got - expected).keys())[:5]}"
    )
    assert all(t.state == "done" for t in trace)
    assert all(0.0 <= t.submit_t <= t.ready_t <= t.start_t <= t.end_t for t in trace)
    stats = result.statistics
    assert stats is not None
    assert (stats.waiting, stats.ready, stats.running, stats.failed) == (0, 0, 0, 0)
    assert stats.submitted == stats.done == len(trace)


def _check_resources(sc: Scenario, tasks: Sequence[Task]) -> None:
    """A resource (a lane, or a device's shared link) runs one task at a time."""
    per_resource: dict[str, list[Task]] = {}
    for t in tasks:
        per_resource.setdefault(sc.resource(t.lane), []).append(t)
    for name, lst in per_resource.items():
        lst.sort(key=lambda t: (t.start_t, t.end_t))
        for a, b in itertools.pairwise(lst):
            assert b.start_t >= a.end_t - 1e-9, f"{name} overlaps {a.describe()} and {b.describe()}"


def _check_priorities(sc: Scenario, trace: Trace) -> None:
    """Whenever a task started on a resource, it was the most urgent (priority, then seq) of the
    tasks on that resource that were ready before that moment and not yet started.

    Tasks that became ready at the very instant another one started are left out here: a
    zero-length task can finish, and ready another, after that instant's starts were made
    (`test_same_instant_completions_still_start_the_most_urgent_task` covers the instant itself)."""
    per_resource: dict[str, list[tuple[int, Task]]] = {}
    for index, t in enumerate(trace.records):  # completion order = start order on one resource
        per_resource.setdefault(sc.resource(t.lane), []).append((index, t))
    for name, entries in per_resource.items():
        started = [t for _, t in sorted(entries, key=lambda e: (e[1].start_t, e[0]))]
        by_ready = sorted(started, key=lambda t: t.ready_t)
        heap: list[tuple[int, int, int]] = []
        waiting: dict[int, Task] = {}
        gone: set[int] = set()
        k = 0
        for task in started:
            assert task.ready_t <= task.start_t, f"{task.describe()} started before it was ready"
            while k < len(by_ready) and by_ready[k].ready_t < task.start_t:
                r = by_ready[k]
                k += 1
                if id(r) not in gone:
                    heapq.heappush(heap, (-r.priority, r.seq, id(r)))
                    waiting[id(r)] = r
            while heap and heap[0][2] not in waiting:
                heapq.heappop(heap)
            if heap and heap[0][2] != id(task) and heap[0] < (-task.priority, task.seq, id(task)):
                other = waiting[heap[0][2]]
                raise AssertionError(
                    f"on {name} at {task.start_t} ms {task.describe()} (priority {task.priority}, "
                    f"seq {task.seq}) started while the more urgent {other.describe()} (priority "
                    f"{other.priority}, seq {other.seq}) was ready since {other.ready_t} ms"
                )
            waiting.pop(id(task), None)
            gone.add(id(task))


def _runs(trace: Trace) -> dict[tuple[int, int, int], list[Task]]:
    """Compute tasks per stage run (iteration, round, slot), in start order."""
    runs: dict[tuple[int, int, int], list[Task]] = {}
    for t in trace:
        if t.kind == COMPUTE:
            runs.setdefault((t.iteration, t.round, t.slot), []).append(t)
    for lst in runs.values():
        lst.sort(key=lambda t: (t.start_t, t.end_t))
    return runs


def _check_run_structure(sc: Scenario, trace: Trace) -> None:
    runs = _runs(trace)
    _check_microbatch_order(runs)
    _check_round_robin(sc, runs)
    uploads: dict[tuple[int, int, int], list[Task]] = {}
    for t in trace:
        if t.kind == PARAM_UP:
            uploads.setdefault((t.iteration, t.round, t.slot), []).append(t)
    _check_prefetch(runs, uploads)
    _check_chunks(sc, runs, uploads)
    _check_lookahead(trace, runs)


def _check_microbatch_order(runs: dict[tuple[int, int, int], list[Task]]) -> None:
    # Microbatch order within a run, and the run stays on one device.
    for key, computes in runs.items():
        mbs = [t.microbatch for t in computes]
        assert mbs == sorted(mbs), f"run {key} computed microbatches in order {mbs}"
        assert [t.part for t in computes] == list(range(len(computes)))
        assert len({t.device for t in computes}) == 1
        for a, b in itertools.pairwise(computes):
            assert b.start_t >= a.end_t - 1e-9


def _check_round_robin(sc: Scenario, runs: dict[tuple[int, int, int], list[Task]]) -> None:
    # Round robin with g0 carried across rounds and iterations, exactly as plan.dispatch says.
    g0 = 0
    expected_device: dict[tuple[int, int, int], int] = {}
    expected_mbs: dict[tuple[int, int, int], list[int]] = {}
    n = sc.num_devices
    for it in range(sc.iterations):
        slot_runs, next_g0 = dispatch(
            sc.plan, sc.num_microbatches, n, iteration=it, first_device=g0, round_size=sc.round_size
        )
        rounds = sorted({r.round for r in slot_runs})
        for r in rounds:
            for run in (x for x in slot_runs if x.round == r):
                assert run.device == (g0 + run.slot.index) % n
                expected_device[(it, r, run.slot.index)] = run.device
                expected_mbs[(it, r, run.slot.index)] = list(run.microbatches)
            g0 = (g0 + sc.plan.num_slots) % n
        assert next_g0 == g0
    assert set(runs) == set(expected_device)
    for key, computes in runs.items():
        assert computes[0].device == expected_device[key], f"run {key}"
        assert [t.microbatch for t in computes] == expected_mbs[key]


def _check_prefetch(
    runs: dict[tuple[int, int, int], list[Task]], uploads: dict[tuple[int, int, int], list[Task]]
) -> None:
    # One stage prefetched per device: an upload of run k on d starts after run k-2 on d ended.
    per_device: dict[int, list[tuple[int, int, int]]] = {}
    for key in sorted(runs):  # (iteration, round, slot) is dispatch order
        per_device.setdefault(runs[key][0].device, []).append(key)
    run_end = {key: computes[-1].end_t for key, computes in runs.items()}
    for device, keys in per_device.items():
        for k, key in enumerate(keys):
            ups = uploads.get(key, [])
            assert all(u.device == device for u in ups)
            if k >= 2:
                bound = run_end[keys[k - 2]]
                for u in ups:
                    assert u.start_t >= bound - 1e-9, (
                        f"{u.describe()} started at {u.start_t} on device {device} while run "
                        f"{keys[k - 2]} (two runs back) was still computing until {bound}"
                    )
            # ... and compute starts only after all its uploads.
            first = runs[key][0]
            assert all(u.end_t <= first.start_t + 1e-9 for u in ups)


def _check_chunks(
    sc: Scenario,
    runs: dict[tuple[int, int, int], list[Task]],
    uploads: dict[tuple[int, int, int], list[Task]],
) -> None:
    # Chunked uploads: per run and layer, the parts add up to the layer's bytes, none too large.
    param_bytes = sc.param_bytes if sc.param_bytes is not None else sc.costs.mem_bytes
    parts: dict[tuple[int, int, int, int], list[Task]] = {}
    for key, ups in uploads.items():
        for u in ups:
            parts.setdefault((*key, u.layers.start), []).append(u)
    for (_it, _round, _slot, layer), chunks in parts.items():
        assert sorted(u.part for u in chunks) == list(range(chunks[0].num_parts))
        assert sum(u.nbytes for u in chunks) == param_bytes[layer]
        if sc.chunk_bytes:
            assert all(u.nbytes <= sc.chunk_bytes for u in chunks)
            assert len(chunks) == max(1, -(-param_bytes[layer] // sc.chunk_bytes))
        else:
            assert len(chunks) == 1
    for key, computes in runs.items():  # every layer of every run was uploaded
        assert {layer for (it, r, slot, layer) in parts if (it, r, slot) == key} == set(computes[0].layers)


def _check_lookahead(trace: Trace, runs: dict[tuple[int, int, int], list[Task]]) -> None:
    # Activation uploads run at most one microbatch ahead of compute.
    computes_by_mb = {(t.iteration, t.slot, t.microbatch): t for t in trace if t.kind == COMPUTE}
    for t in trace:
        if t.kind != ACT_UP:
            continue
        mine = computes_by_mb[(t.iteration, t.slot, t.microbatch)]
        assert t.device == mine.device and t.end_t <= mine.start_t + 1e-9
        if mine.part >= 2:
            two_back = runs[(t.iteration, t.round, t.slot)][mine.part - 2]
            assert t.start_t >= two_back.end_t - 1e-9, (
                f"{t.describe()} started at {t.start_t} before {two_back.describe()} ended at {two_back.end_t}"
            )


def _check_not_vacuous(sc: Scenario, trace: Trace) -> None:
    """The rule checker has something to compare for every unit."""
    units = range(sc.costs.num_layers)
    by_kind: dict[str, set[tuple[int, int]]] = {}
    for t in trace:
        for layer in t.layers:
            by_kind.setdefault(t.kind, set()).add(
                (layer, t.iteration if t.kind in (G_COPY, GRAD_DOWN) else t.step)
            )
    for u in units:
        for it in range(sc.iterations):
            assert (u, it) in by_kind[G_COPY]
            assert (u, it) in by_kind[GRAD_DOWN]
            assert (u, it) in by_kind[STEP]
        assert any(layer == u for layer, _ in by_kind[PARAM_UP])
        p_copy_steps = range(sc.iterations) if not sc.async_optimizer else range(sc.iterations - 1)
        for s in p_copy_steps:
            assert (u, s) in by_kind[P_COPY]
    # Rule 1 pairs: every P-copy(u, s) has uploads that read version s before it overwrote it.
    p_copies = {(t.layers.start, t.step) for t in trace if t.kind == P_COPY}
    readers = {(t.layers.start, t.step) for t in trace if t.kind == PARAM_UP}
    assert p_copies <= readers
    # Rule 2 pairs: every upload of a version v > 0 has the P-copy(v - 1) that wrote it.
    assert {(u, v - 1) for u, v in readers if v > 0} <= p_copies


@PROPERTY_SETTINGS
@given(scenarios())
def test_schedule_properties(sc: Scenario) -> None:
    result = sc.run()
    trace = result.trace
    assert result.makespan_ms >= 0.0 and 0.0 <= result.bubble_ratio <= 1.0
    _check_runs_once(sc, result)
    rules.check_lanes(trace.records)
    rules.check_dependencies(trace.records)
    trace.check_rules()
    _check_resources(sc, trace.records)
    _check_priorities(sc, trace)
    _check_run_structure(sc, trace)
    _check_not_vacuous(sc, trace)


# --------------------------------------------------------------------- known engine issue


def _engine_run(tasks: list[Task], ms: dict[str, float]) -> Trace:
    from roundpipe.sched.engine import Engine
    from roundpipe.sched.event_loop import run_sync

    engine = Engine(FakeBackend(durations=lambda t: ms[t.key[0]]))

    async def main() -> None:
        engine.submit(tasks)
        await engine.wait()

    run_sync(main())
    return engine.trace


def test_same_instant_completions_still_start_the_most_urgent_task() -> None:
    tasks = [
        Task(("a",), COMPUTE, "d0.compute"),
        Task(("b",), COMPUTE, "d1.compute"),
        Task(("low",), GRAD_DOWN, "d0.grad_down", deps=[("a",)], priority=10),
        Task(("high",), ACT_DOWN, "d0.grad_down", deps=[("b",)], priority=30),
    ]
    trace = _engine_run(tasks, {"a": 1.0, "b": 1.0, "low": 5.0, "high": 1.0})
    times = {t.key[0]: (t.ready_t, t.start_t) for t in trace}
    assert times["low"][0] == times["high"][0] == 1.0  # both ready at t = 1 ms, same resource
    assert times["high"][1] == 1.0  # the more urgent one starts first
    assert times["low"][1] == 2.0
