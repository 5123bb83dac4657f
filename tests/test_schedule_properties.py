"""Schedule properties of the real engine + real task graphs on the fake backend, over random runs.

Hypothesis draws layer costs, plans (from `partition` or hand-made with `Plan.from_stages`),
1-8 devices, 1-32 microbatches, 1-3 iterations, sync/async, with and without link bandwidth,
parameter/activation bytes, upload chunking, a shared link, round sizes and a random
`Perturbation` (delays and jitter per task kind). On every resulting trace we check what the
design promises: each task runs once, lanes and resources run one task at a time, dependencies and
the five rules hold, the most urgent ready task starts first, nothing is left waiting, microbatch
order, one-stage prefetch, one-microbatch activation lookahead, and round-robin placement.

Then the rule checker itself is tested: a valid trace is tampered to break each rule in turn, and
the checker must name the rule and the tasks (and must not be vacuous).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roundpipe.backends.fake import FakeBackend, Perturbation
from roundpipe.plan import LayerCosts, Plan, dispatch, partition
from roundpipe.sched import rules
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.rules import RuleViolation
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
from roundpipe.simulate import SimulationResult, simulate

KINDS = (PARAM_UP, ACT_UP, COMPUTE, ACT_DOWN, GRAD_DOWN, G_COPY, STEP, P_COPY)
PROPERTY_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    costs: LayerCosts
    plan: Plan
    num_devices: int
    num_microbatches: int
    iterations: int
    async_optimizer: bool
    link_gbps: float | None
    param_bytes: tuple[int, ...] | None
    act_bytes: int
    chunk_bytes: int | None
    optimizer_ms: float
    latency_ms: float
    round_size: int | None
    shared_link: bool
    perturbation: Perturbation | None

    def run(self) -> SimulationResult:
        return simulate(
            self.plan,
            self.costs,
            self.num_devices,
            self.num_microbatches,
            self.iterations,
            self.async_optimizer,
            self.link_gbps,
            param_bytes=self.param_bytes,
            act_bytes=self.act_bytes,
            chunk_bytes=self.chunk_bytes,
            optimizer_ms=self.optimizer_ms,
            latency_ms=self.latency_ms,
            round_size=self.round_size,
            shared_link=self.shared_link,
            perturbation=self.perturbation,
        )

    def builder(self) -> GraphBuilder:
        """A twin of the builder `simulate` uses (same spec and options)."""
        spec = ModelSpec(
            param_bytes=tuple(self.param_bytes if self.param_bytes is not None else self.costs.mem_bytes),
            owners=tuple((layer,) for layer in range(self.costs.num_layers)),
            act_bytes=self.act_bytes,
        )
        options = ScheduleOptions(
            async_optimizer=self.async_optimizer, round_size=self.round_size, chunk_bytes=self.chunk_bytes
        )
        return GraphBuilder(self.plan, spec, self.num_devices, options)

    def resource(self, lane: str) -> str:
        return FakeBackend(durations={}, shared_link=self.shared_link).resource(lane)


_ms = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0]),  # ties and zero-length tasks stress the engine
    st.floats(min_value=0.01, max_value=8.0, allow_nan=False, allow_infinity=False),
)


def _composition(draw: st.DrawFn, start: int, stop: int) -> list[range]:
    """A random split of [start, stop) into non-empty consecutive ranges, shallow first."""
    if stop <= start:
        return []
    cuts = sorted(
        draw(st.sets(st.integers(start + 1, stop - 1), max_size=stop - start - 1)) if stop - start > 1 else []
    )
    bounds = [start, *cuts, stop]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    num_layers = draw(st.integers(1, 8))
    costs = LayerCosts(
        tuple(draw(st.lists(_ms, min_size=num_layers, max_size=num_layers))),
        tuple(draw(st.lists(_ms, min_size=num_layers, max_size=num_layers))),
        tuple(draw(st.lists(st.integers(0, 4 << 20), min_size=num_layers, max_size=num_layers))),
    )
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 32))
    async_optimizer = draw(st.booleans())
    if draw(st.booleans()):
        plan = partition(costs, n, m, async_optimizer=async_optimizer)
    else:
        fused_start = draw(st.integers(0, num_layers - 1))
        fwd = _composition(draw, 0, fused_start)
        bwd = list(reversed(_composition(draw, 0, fused_start)))
        plan = Plan.from_stages(fwd, range(fused_start, num_layers), bwd, costs, n, m)
    # Keep a run under ~8k tasks so a hundred examples stay fast.
    iterations = draw(st.integers(1, 3))
    while iterations > 1 and iterations * m * plan.num_slots > 2500:
        iterations -= 1
    if m * plan.num_slots > 2500:
        m = max(1, 2500 // plan.num_slots)
    link_gbps = draw(st.one_of(st.none(), st.floats(0.5, 64.0)))
    param_bytes = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, 8 << 20), min_size=num_layers, max_size=num_layers).map(tuple),
        )
    )
    act_bytes = draw(st.sampled_from([0, 1 << 10, 1 << 20, 3 << 20]))
    chunk_bytes = draw(st.one_of(st.none(), st.sampled_from([1 << 18, 1 << 20, 3 << 20])))
    optimizer_ms = draw(st.sampled_from([0.0, 0.05, 0.5, 2.0]))
    latency_ms = draw(st.sampled_from([0.0, 0.0, 0.01]))
    round_size = draw(st.one_of(st.none(), st.integers(n, max(n, m))))
    shared_link = draw(st.booleans())
    perturbation = None
    if draw(st.booleans()):
        kinds = st.sampled_from(KINDS)
        perturbation = Perturbation(
            delay_ms=draw(st.dictionaries(kinds, st.floats(0.0, 3.0), max_size=4)),
            jitter=draw(st.dictionaries(kinds, st.floats(0.0, 0.9), max_size=4)),
            seed=draw(st.integers(0, 2**16)),
        )
    return Scenario(
        costs,
        plan,
        n,
        m,
        iterations,
        async_optimizer,
        link_gbps,
        param_bytes,
        act_bytes,
        chunk_bytes,
        optimizer_ms,
        latency_ms,
        round_size,
        shared_link,
        perturbation,
    )


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
    # Microbatch order within a run, and the run stays on one device.
    for key, computes in runs.items():
        mbs = [t.microbatch for t in computes]
        assert mbs == sorted(mbs), f"run {key} computed microbatches in order {mbs}"
        assert [t.part for t in computes] == list(range(len(computes)))
        assert len({t.device for t in computes}) == 1
        for a, b in itertools.pairwise(computes):
            assert b.start_t >= a.end_t - 1e-9

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

    # One stage prefetched per device: an upload of run k on d starts after run k-2 on d ended.
    per_device: dict[int, list[tuple[int, int, int]]] = {}
    for key in sorted(runs):  # (iteration, round, slot) is dispatch order
        per_device.setdefault(runs[key][0].device, []).append(key)
    run_end = {key: computes[-1].end_t for key, computes in runs.items()}
    uploads: dict[tuple[int, int, int], list[Task]] = {}
    for t in trace:
        if t.kind == PARAM_UP:
            uploads.setdefault((t.iteration, t.round, t.slot), []).append(t)
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
    from roundpipe.sched.loop import run_sync

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


# --------------------------------------------------------------------- the checker, tampered


@pytest.fixture(scope="module")
def valid_trace() -> Trace:
    costs = LayerCosts((1.0, 1.5, 2.0), (2.0, 3.0, 4.0), (1 << 20, 1 << 20, 2 << 20))
    plan = partition(costs, 2, 4)
    result = simulate(
        plan, costs, 2, 4, iterations=3, async_optimizer=False, link_gbps=10.0, optimizer_ms=0.5
    )
    result.trace.check_rules()
    return result.trace


def _copy(trace: Trace, *, keep_deps: bool = False) -> Trace:
    """A deep copy; without declared dependencies, so only the rule checks themselves can object."""
    out = Trace.from_dict(trace.to_dict())
    if not keep_deps:
        for t in out:
            t.deps = ()
    return out


def _find(trace: Trace, kind: str, **fields: object) -> list[Task]:
    return [t for t in trace if t.kind == kind and all(getattr(t, k) == v for k, v in fields.items())]


def _isolate(task: Task) -> None:
    """Move a tampered task to a lane of its own, so the lane check cannot be what objects."""
    task.lane = f"tampered.{task.kind}"


def _assert_violation(trace: Trace, rule: int | str, *named: Task) -> RuleViolation:
    with pytest.raises(RuleViolation) as info:
        trace.check_rules()
    violation = info.value
    assert violation.rule == rule, str(violation)
    keys = {t.key for t in violation.tasks}
    for task in named:
        assert task.key in keys, (task.describe(), str(violation))
        assert task.describe() in str(violation)
    if isinstance(rule, int):
        assert f"rule {rule} ({rules.RULE_NAMES[rule]}) broken" in str(violation)
    return violation


def test_checker_is_not_vacuous(valid_trace: Trace) -> None:
    units = range(3)
    kinds = Counter(t.kind for t in valid_trace)
    assert all(kinds[k] > 0 for k in KINDS)
    for u in units:
        for s in range(3):
            assert _find(valid_trace, P_COPY, step=s, layers=range(u, u + 1))
            assert _find(valid_trace, STEP, step=s, layers=range(u, u + 1))
            assert _find(valid_trace, G_COPY, iteration=s, layers=range(u, u + 1))
            assert [t for t in _find(valid_trace, PARAM_UP, step=s) if u in t.layers]  # readers of version s
            assert [t for t in _find(valid_trace, GRAD_DOWN, iteration=s) if u in t.layers]
    # The rule checks hold without the declared dependencies too (they check times, not edges).
    _copy(valid_trace).check_rules()


def test_rule_1_weight_integrity(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    pc = _find(trace, P_COPY, step=1, layers=range(0, 1))[0]
    up = next(t for t in _find(trace, PARAM_UP, step=1) if 0 in t.layers)
    up.end_t = pc.start_t + 0.25  # the upload still reads version 1 while P-copy(1) overwrites it
    _isolate(up)
    _assert_violation(trace, 1, pc, up)


def test_rule_2_no_torn_weights(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    pc = _find(trace, P_COPY, step=1, layers=range(1, 2))[0]
    up = next(t for t in _find(trace, PARAM_UP, step=2) if 1 in t.layers)
    up.start_t = pc.end_t - 0.01  # reads version 2 before P-copy(1) finished writing it
    _isolate(up)
    _assert_violation(trace, 2, pc, up)


def test_rule_3_complete_gradients(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    gc = _find(trace, G_COPY, iteration=1, layers=range(2, 3))[0]
    down = next(t for t in _find(trace, GRAD_DOWN, iteration=1) if 2 in t.layers)
    gc.start_t = down.end_t - 0.01
    _isolate(gc)
    _assert_violation(trace, 3, gc, down)


def test_rule_4_gradient_write_order(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    gc = _find(trace, G_COPY, iteration=0, layers=range(0, 1))[0]
    down = min((t for t in _find(trace, GRAD_DOWN, iteration=1) if 0 in t.layers), key=lambda t: t.start_t)
    down.start_t = gc.end_t - 0.01  # writes iteration 1's gradients before G-copy(0) read them
    _isolate(down)
    _assert_violation(trace, 4, down, gc)


def test_rule_5_step_after_previous_p_copy(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    st = _find(trace, STEP, step=2, layers=range(1, 2))[0]
    pc = _find(trace, P_COPY, step=1, layers=range(1, 2))[0]
    st.start_t = pc.end_t - 0.01
    _isolate(st)
    _assert_violation(trace, 5, st, pc)


def test_rule_5_step_after_its_g_copies(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    gc = _find(trace, G_COPY, iteration=1, layers=range(0, 1))[0]
    st = _find(trace, STEP, step=1, layers=range(0, 1))[0]
    gc.end_t = st.start_t + 0.01  # the step read gradients the G-copy had not finished
    _isolate(gc)
    _assert_violation(trace, 5, gc, st)


def test_rule_5_shallow_units_first() -> None:
    shallow = Task(("step", 0, 0), STEP, "host.optimizer", layers=range(0, 1), step=0)
    deep = Task(("step", 0, 1), STEP, "host.optimizer", layers=range(1, 2), step=0)
    for task, (ready, start, end) in ((shallow, (0.0, 2.0, 3.0)), (deep, (0.0, 0.5, 2.0))):
        task.ready_t, task.start_t, task.end_t, task.state = ready, start, end, "done"
    _assert_violation(Trace([deep, shallow]), 5, deep, shallow)
    shallow.ready_t = 0.5  # not ready before the deep one started: going ahead was right
    Trace([deep, shallow]).check_rules()


def test_broken_dependency_is_named(valid_trace: Trace) -> None:
    trace = _copy(valid_trace, keep_deps=True)
    compute = _find(trace, COMPUTE, iteration=1, slot=0, part=0)[0]
    up = next(t for t in trace if t.key in compute.deps and t.kind == PARAM_UP)
    assert up.end_t > up.start_t
    compute.start_t = up.end_t - 0.01
    _assert_violation(trace, "dependency", compute, up)


def test_rules_are_also_declared_dependencies(valid_trace: Trace) -> None:
    """With the declared edges kept, breaking rule 1 is caught as a broken dependency first."""
    trace = _copy(valid_trace, keep_deps=True)
    pc = _find(trace, P_COPY, step=1, layers=range(0, 1))[0]
    up = next(t for t in _find(trace, PARAM_UP, step=1) if 0 in t.layers)
    assert up.key in pc.deps
    up.end_t = pc.start_t + 0.25
    _assert_violation(trace, "dependency", up)


def test_lane_overlap_is_named(valid_trace: Trace) -> None:
    trace = _copy(valid_trace)
    on_lane = sorted((t for t in trace if t.lane == "d0.compute"), key=lambda t: t.start_t)
    a, b = next((a, b) for a, b in itertools.pairwise(on_lane) if a.end_t > a.start_t)
    b.start_t = (a.start_t + a.end_t) / 2
    violation = _assert_violation(trace, "lane", a, b)
    assert "d0.compute" in str(violation)
    rules.check_dependencies(trace.records)  # only the lane is broken
