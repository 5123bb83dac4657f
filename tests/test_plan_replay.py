"""The replay evaluator (`roundpipe.planning.replay`) equals the engine it stands in for.

Two checks, each on plans of every dispatch kind (one round and several, uneven rounds, a round
size, few slots and more slots than devices, a plan cut by memory, sync and async): the flat graph
of `roundpipe.planning.replay_graph` is the graph `GraphBuilder` makes, task for task (resource, priority,
duration, dependencies, submission batches); and the iteration times the replay gives equal, to
the last bit, what the engine gives on the fake backend, for async runs submitted at once
(chained) and as a training loop submits them (each iteration once the previous losses are in).
And on random plans (zero-time stages among them) the lean graph the evaluator replays gives the
times of the full one, and the loop's times the engine's.
"""

from __future__ import annotations

import itertools
import random

import pytest

from roundpipe.backends.fake import FakeBackend, FakeCostModel
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.planning import replay_graph
from roundpipe.planning.ranking import engine_evaluator
from roundpipe.planning.replay import replay_starts
from roundpipe.planning.replay_graph import COMPUTE_RES, D2H_RES, H2D_RES, build_graph
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import PRIORITY, Task

GIB = 2**30


def costs_of(layers: int, ratio: float, head: float, mem: int = 0) -> LayerCosts:
    fwd = [0.01, *[1.0] * layers, head]
    bwd = [0.01 * ratio, *[ratio] * layers, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (mem,) * len(fwd))


def plans() -> list[tuple[str, Plan, LayerCosts, int, int, int | None]]:
    """(name, plan, costs, N, M, round size) over the dispatch kinds."""
    out = []
    for name, costs, n, m, rs in [
        ("8x16", costs_of(10, 2.0, 3.0), 8, 16, None),
        ("4x8", costs_of(6, 3.8, 1.0), 4, 8, None),
        ("3x7 one round", costs_of(7, 1.3, 4.0), 3, 7, None),
        ("2x7 rounds of 3", costs_of(5, 2.5, 2.0), 2, 7, 3),
    ]:
        for asynch in (False, True):
            plan = partition(costs, n, m, async_optimizer=asynch)
            out.append((f"{name} {'async' if asynch else 'sync'}", plan, costs, n, m, rs))
    wide = costs_of(6, 2.0, 2.0)  # more slots than devices, a 1-layer fused stage
    fwd = [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    bwd = [range(6, 7), range(4, 6), range(2, 4), range(1, 2), range(0, 1)]
    out.append(("wide", Plan.from_stages(fwd, range(7, 8), bwd, wide, 2, 4), wide, 2, 4, None))
    one = costs_of(6, 2.0, 3.0)  # one device: a backward run's first recompute after the previous run
    stages = [range(0, 3), range(3, 6)]
    plan_1 = Plan.from_stages(stages, range(6, 8), stages[::-1], one, 1, 4)
    out.append(("one device", plan_1, one, 1, 4, 4))
    narrow = costs_of(4, 2.0, 3.0)  # one slot: everything fused
    out.append(("fused only", Plan.from_stages([], range(0, 6), [], narrow, 4, 8), narrow, 4, 8, None))
    tight = costs_of(8, 2.0, 3.0, mem=GIB)  # stages cut by a memory limit
    out.append(("memory", partition(tight, 4, 8, 6 * GIB, async_optimizer=True), tight, 4, 8, None))
    return out


CASES = plans()


def engine_graph(
    plan: Plan, costs: LayerCosts, n: int, m: int, rs: int | None, asynch: bool
) -> list[list[Task]]:
    """What `roundpipe.planning.simulate.run_fake` submits for the evaluator, batch by batch."""
    spec = ModelSpec(param_bytes=costs.mem_bytes, owners=tuple((i,) for i in range(costs.num_layers)))
    builder = GraphBuilder(plan, spec, n, ScheduleOptions(async_optimizer=asynch, round_size=rs))
    batches = []
    for it in range(6 if asynch else 1):
        batches += [builder.forward_backward(it, it, m).tasks, builder.optimizer_step(it)]
    return batches


@pytest.mark.parametrize(("name", "plan", "costs", "n", "m", "rs"), CASES, ids=[c[0] for c in CASES])
def test_the_flat_graph_is_the_engine_graph(
    name: str, plan: Plan, costs: LayerCosts, n: int, m: int, rs: int | None
) -> None:
    for asynch in (False, True):
        batches = engine_graph(plan, costs, n, m, rs, asynch)
        graph = build_graph(plan, costs, n, m, 6 if asynch else 1, asynch, rs, lean=False)
        tasks = [t for batch in batches for t in batch]
        assert graph.batches == [sum(len(b) for b in batches[: i + 1]) for i in range(len(batches))]
        seq = {t.key: i for i, t in enumerate(tasks)}
        backend = FakeBackend(FakeCostModel(costs), shared_link=True)
        offset = {"compute": COMPUTE_RES, "h2d": H2D_RES, "d2h": D2H_RES}
        dependents: list[list[int]] = [[] for _ in tasks]
        for i, task in enumerate(tasks):
            resource = backend.resource(task.lane)
            device, _, lane = resource.partition(".")
            expected = graph.host if task.device < 0 else 3 * int(device[1:]) + offset[lane]
            assert graph.res[i] == expected, (name, task.describe())
            assert graph.rank[i] // graph.seq == 100 - PRIORITY[task.kind], task.describe()
            assert graph.rank[i] % graph.seq == i
            assert graph.dur[i] == backend.duration(task), task.describe()
            assert graph.unmet[i] == len(task.deps), task.describe()
            for dep in task.deps:
                dependents[seq[dep]].append(i)
        assert [sorted(d) for d in graph.dependents] == [sorted(d) for d in dependents]


@pytest.mark.parametrize(("name", "plan", "costs", "n", "m", "rs"), CASES, ids=[c[0] for c in CASES])
def test_replay_times_equal_the_engine(
    name: str, plan: Plan, costs: LayerCosts, n: int, m: int, rs: int | None
) -> None:
    for asynch in (False, True):
        windows = [(1, 5), (1, 3), (0, 2)] if asynch else [(1, 5)]
        for window, (loop, lag) in itertools.product(windows, ((True, 0), (True, 1), (False, 0))):
            args = (costs, n, m)
            options = {"async_optimizer": asynch, "round_size": rs, "window": window, "loop": loop}
            replay = engine_evaluator(*args, **options, loss_lag=lag)
            engine = engine_evaluator(*args, **options, loss_lag=lag, engine=True)
            assert replay(plan) == engine(plan), (name, asynch, window, loop, lag)


def replayed_ms(
    plan: Plan,
    costs: LayerCosts,
    n: int,
    m: int,
    rs: int | None,
    window: tuple[int, int] | None,
    lean: bool,
    loop: bool = False,
    loss_lag: int = 0,
) -> float:
    """`replay_iteration_ms` on the lean or the full graph (``window`` None: sync)."""
    graph = build_graph(
        plan, costs, n, m, 1 if window is None else window[1] + 1, window is not None, rs, lean=lean
    )
    if window is None:
        starts = replay_starts(graph)
        return max(s + d for s, d in zip(starts, graph.dur, strict=True)) - min(starts)
    stop = bytearray(len(graph.res))
    for task in graph.computes[window[1]]:
        stop[task] = 1
    starts = replay_starts(graph, stop, loop=loop, loss_lag=loss_lag)
    at = [min(starts[t] for t in graph.computes[i] if starts[t] >= 0.0) for i in window]
    return (at[1] - at[0]) / (window[1] - window[0])


def random_chain(rng: random.Random, stop: int) -> list[range]:
    ends = [0, *sorted(rng.sample(range(1, stop), rng.randint(0, stop - 1))), stop]
    return [range(a, b) for a, b in itertools.pairwise(ends)]


def test_the_lean_graph_gives_the_full_graphs_times() -> None:
    rng = random.Random(7)
    for _ in range(150):
        layers = rng.randint(1, 10)
        fwd = [rng.choice([0.0, 0.5, 1.0, 1.0, 2.0]) for _ in range(layers)]
        bwd = [x * rng.choice([0.0, 1.3, 2.0]) for x in fwd]
        costs = LayerCosts(tuple(fwd), tuple(bwd), (0,) * layers)
        n = rng.choice([1, 2, 3, 4])
        m, rs = rng.choice([n, n + 1, 2 * n, 3 * n]), rng.choice([None, None, n])
        p = rng.randint(0, layers - 1)
        fwd_stages, bwd_stages = (random_chain(rng, p), random_chain(rng, p)[::-1]) if p else ([], [])
        plan = Plan.from_stages(fwd_stages, range(p, layers), bwd_stages, costs, n, m)
        window = rng.choice([None, (1, 5), (1, 3), (0, 2)])
        loop = window is not None and rng.random() < 0.5
        lag = int(loop and rng.random() < 0.5)
        args = (plan, costs, n, m, rs, window)
        lean = replayed_ms(*args, lean=True, loop=loop, loss_lag=lag)
        assert lean == replayed_ms(*args, lean=False, loop=loop, loss_lag=lag), (args, loop, lag)
        if loop:  # and the loop's submission is the engine's (`simulate(..., after_loss=True)`)
            options = {"async_optimizer": True, "round_size": rs, "window": window, "loss_lag": lag}
            assert lean == engine_evaluator(costs, n, m, **options, engine=True)(plan), (args, lag)


def test_heap_keys_grow_with_a_graph_past_seq(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph of more tasks than ``SEQ`` widens its keys (here SEQ is made 4 to see it)."""
    name, plan, costs, n, m, rs = CASES[0]
    expected = replayed_ms(plan, costs, n, m, rs, (1, 5), lean=True)
    monkeypatch.setattr(replay_graph, "SEQ", 4)
    graph = build_graph(plan, costs, n, m, 6, True, rs)
    assert graph.seq > len(graph.res) > 4
    assert replayed_ms(plan, costs, n, m, rs, (1, 5), lean=True) == expected, name
