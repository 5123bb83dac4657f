"""The compiled loops of plan evaluation (`roundpipe.plan.native`) give what the Python loops give.

What must hold: every function of `_kernels.c` stands in for a Python loop and must decide
nothing differently: the replay graph built in C is the engine's graph as `roundpipe.planning.replay_graph`
renders it, array for array and in the same order; the replay, the stream model and the split model give the same floats to
the last bit, given up or not; and `choose_evaluated_plan` chooses the same plan in every mode.
Each check runs the same inputs through both (`native.pure_python()` turns the compiled loops
off). Where CI asks for the compiled loops (``ROUNDPIPE_EXPECT_NATIVE=1``, set by .ci/run), a
build that failed silently is an error, not a skip.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import pytest

from roundpipe.plan import LayerCosts, Plan, native, partition
from roundpipe.plan._candidates import balanced_split
from roundpipe.plan._ranking import _StageTimes
from roundpipe.plan._search import Ticks, to_ticks
from roundpipe.plan._sharing import sharers_and_waits
from roundpipe.plan._split_stream import SplitGraph, split_ms
from roundpipe.plan._steady import steady_bound, steady_bound_ticks, steady_period
from roundpipe.plan._stream import stream_ms
from roundpipe.plan.dispatch import busiest_device_share
from roundpipe.plan.rounds import round_sizes
from roundpipe.planning.ranking import choose_evaluated_plan, engine_evaluator, late_loop_evaluator
from roundpipe.planning.replay import _first_computes, replay_run, replay_starts
from roundpipe.planning.replay_graph import build_graph

needs_native = pytest.mark.skipif(not native.built(), reason="the compiled loops were not built here")


def test_the_compiled_loops_are_built_where_ci_expects_them() -> None:
    if os.environ.get("ROUNDPIPE_EXPECT_NATIVE") != "1":
        pytest.skip("ROUNDPIPE_EXPECT_NATIVE is not set")
    assert native.built(), "roundpipe.plan._kernels did not build: is a C compiler installed?"
    assert native.kernels() is not None


@needs_native
@pytest.mark.parametrize(
    ("missing", "interface_behind", "message"),
    [
        ("first_starts", 0, r"older source \(no first_starts\).*build_ext --inplace"),
        (None, 1, r"older source \(no interface \d+\).*build_ext --inplace"),
    ],
    ids=["a-function-missing", "another-interface"],
)
def test_an_extension_built_from_older_source_is_set_aside(
    monkeypatch: pytest.MonkeyPatch, missing: str | None, interface_behind: int, message: str
) -> None:
    """An editable install not rebuilt since `_kernels.c` gained a function, or since a function's
    arguments changed (its ``INTERFACE`` behind `native.INTERFACE`: every function there, called
    with arguments it does not take): planning falls back to the Python loops with a warning that
    says how to rebuild, instead of failing mid-plan."""
    import importlib
    import sys
    import types

    stale = types.ModuleType("roundpipe.plan._kernels")
    for name in native.FUNCTIONS:
        if name != missing:
            setattr(stale, name, getattr(native.kernels(), name))
    stale.INTERFACE = native.INTERFACE - interface_behind  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "roundpipe.plan._kernels", stale)
    try:
        with pytest.warns(RuntimeWarning, match=message):
            importlib.reload(native)
        assert not native.built() and native.kernels() is None
    finally:
        monkeypatch.undo()
        importlib.reload(native)
    assert native.built()


def costs_of(layers: int, ratio: float, head: float) -> LayerCosts:
    fwd = [0.01, *[1.0] * layers, head]
    bwd = [0.01 * ratio, *[ratio] * layers, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def random_chain(rng: random.Random, stop: int) -> list[range]:
    ends = [0, *sorted(rng.sample(range(1, stop), rng.randint(0, stop - 1))), stop]
    return [range(a, b) for a, b in itertools.pairwise(ends)]


def random_plans(seed: int, count: int) -> list[tuple[Plan, LayerCosts, int, int, int | None]]:
    """Random plans of every dispatch kind, zero-time stages among them."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        layers = rng.randint(1, 12)
        fwd = [rng.choice([0.0, 0.5, 1.0, 1.0, 2.0]) for _ in range(layers)]
        bwd = [x * rng.choice([0.0, 1.3, 2.0]) for x in fwd]
        costs = LayerCosts(tuple(fwd), tuple(bwd), (0,) * layers)
        n = rng.choice([1, 2, 3, 4, 8])
        m, rs = rng.choice([n, n + 1, 2 * n, 3 * n]), rng.choice([None, None, n])
        p = rng.randint(0, layers - 1)
        fwd_stages, bwd_stages = (random_chain(rng, p), random_chain(rng, p)[::-1]) if p else ([], [])
        out.append((Plan.from_stages(fwd_stages, range(p, layers), bwd_stages, costs, n, m), costs, n, m, rs))
    return out


def random_rounds(rng: random.Random) -> tuple[int, tuple[int, ...]]:
    """A device count and the rounds of a microbatch count of one to three rounds and a bit."""
    n = rng.choice([1, 2, 3, 4, 8])
    return n, round_sizes(rng.choice([n, n + 1, 2 * n, 3 * n + 1]), n)


def graph_fields(
    plan: Plan, costs: LayerCosts, n: int, m: int, rs: int | None, its: int, asynch: bool, lean: bool
):
    graph = build_graph(plan, costs, n, m, its, asynch, rs, lean=lean)
    return (
        list(graph.res),
        list(graph.rank),
        list(graph.dur),
        graph.seq,
        graph.unmet,
        graph.dependents,  # in the same order, not only the same sets
        list(graph.batches),
        [list(c) for c in graph.computes],
        [list(c) for c in graph.losses],
        graph.host,
    )


@needs_native
def test_the_compiled_builder_builds_the_python_graph() -> None:
    for plan, costs, n, m, rs in random_plans(3, 120):
        for asynch, lean in itertools.product((False, True), (False, True)):
            its = 6 if asynch else 1
            compiled = graph_fields(plan, costs, n, m, rs, its, asynch, lean)
            with native.pure_python():
                expected = graph_fields(plan, costs, n, m, rs, its, asynch, lean)
            assert compiled == expected, (plan, n, m, rs, asynch, lean)


def replay_both(plan: Plan, costs: LayerCosts, n: int, m: int, rs: int | None, rng: random.Random) -> None:
    asynch = rng.random() < 0.7
    its = 6 if asynch else 1
    loop, lag = (rng.random() < 0.6, rng.choice([0, 1])) if asynch else (False, 0)
    with native.pure_python():
        graph = build_graph(plan, costs, n, m, its, asynch, rs)
        stop = bytearray(len(graph.res))
        if asynch:
            for task in graph.computes[rng.choice([2, 5])]:
                stop[task] = 1
        beyond = rng.randint(0, len(graph.res))  # and the earliest start of the tasks from there
        expected_run = replay_run(graph, stop, loop=loop, loss_lag=lag, beyond=beyond)
        expected = list(expected_run[0])
    assert list(replay_starts(graph, stop, loop=loop, loss_lag=lag)) == expected
    compiled_graph = build_graph(plan, costs, n, m, its, asynch, rs)
    starts, earliest = replay_run(compiled_graph, stop, loop=loop, loss_lag=lag, beyond=beyond)
    assert (list(starts), earliest) == (expected, expected_run[1])
    assert earliest == min((at for at in expected[beyond:] if at >= 0.0), default=-1.0)
    if asynch:  # each iteration's first compute, as the settled evaluation reads them
        upto = rng.randint(1, its)
        try:
            with native.pure_python():
                first = _first_computes(graph, upto, loop, lag)
        except ValueError:  # an earlier iteration not started yet (chained, zero-time stages)
            with pytest.raises(ValueError):
                _first_computes(compiled_graph, upto, loop, lag)
        else:
            assert _first_computes(compiled_graph, upto, loop, lag) == first


@needs_native
def test_the_compiled_replay_gives_every_start_of_the_python_replay() -> None:
    rng = random.Random(5)
    for plan, costs, n, m, rs in random_plans(4, 150):
        replay_both(plan, costs, n, m, rs, rng)


@needs_native
def test_the_compiled_stream_model_gives_the_python_times() -> None:
    rng = random.Random(11)
    for _ in range(300):
        n, rounds = random_rounds(rng)
        s_count = rng.randint(1, 16)
        slots = [rng.choice([0.0, 0.01, 0.5, 1.0, 2.0, 3.7]) * rng.randint(1, 9) for _ in range(s_count)]
        waits = [sorted(rng.sample(range(s_count), rng.randint(0, min(3, s_count)))) for _ in slots]
        shares = [sorted(rng.sample(range(s_count), rng.randint(0, min(3, s_count)))) for _ in slots]
        kind = rng.choice(["sync", "window", "loop"])
        options: dict[str, object] = {}
        if kind != "sync":
            options = {
                "iterations": 6 if kind == "loop" else 4,
                "window": (1, 5) if kind == "loop" else (1, 3),
            }
            options |= {"weight_waits": waits, "sharers": rng.choice([None, shares])}
            if kind == "loop":
                options["gate"] = rng.randrange(s_count)
                options["gate_lag"] = rng.choice([0, 1])
        with native.pure_python():
            full = stream_ms(slots, n, rounds, **options)  # type: ignore[arg-type]
            bound = full * rng.choice([0.5, 0.99, 1.0, 1.01]) if full < math.inf else math.inf
            cut = stream_ms(slots, n, rounds, **options, give_up=bound)  # type: ignore[arg-type]
        assert stream_ms(slots, n, rounds, **options) == full  # type: ignore[arg-type]
        assert stream_ms(slots, n, rounds, **options, give_up=bound) == cut  # type: ignore[arg-type]


@needs_native
def test_the_compiled_split_model_gives_the_python_times() -> None:
    rng = random.Random(12)
    checked = 0
    for layers, ratio, head in itertools.product((6, 13, 24), (1.3, 3.8), (1.0, 4.0)):
        costs = costs_of(layers, ratio, head)
        times = _StageTimes(costs)
        for n in (1, 2, 4, 8):
            plan = partition(costs, n, 2 * n)
            rounds = round_sizes(rng.choice([n, 2 * n, 2 * n + 1]), n)
            split = times.split(plan.fwd_stages, plan.fused, plan.bwd_stages)
            with native.pure_python():
                full = split_ms(plan.slot_ms, split, n, rounds)
                cut = split_ms(plan.slot_ms, split, n, rounds, give_up=full * 0.98)
            assert split_ms(plan.slot_ms, split, n, rounds) == full
            assert split_ms(plan.slot_ms, split, n, rounds, give_up=full * 0.98) == cut
            checked += 1
    assert checked == 48


CHOICES = [
    (layers, ratio, head, n, m, mode)
    for layers, (ratio, head), (n, m), mode in itertools.product(
        (24, 48), ((1.3, 1.0), (2.5, 3.0), (3.8, 4.0)), ((8, 16), (4, 8)), ("sync", "async", "lag1")
    )
]


@needs_native
@pytest.mark.parametrize(("layers", "ratio", "head", "n", "m", "mode"), CHOICES)
def test_the_same_plan_is_chosen_with_and_without_the_compiled_loops(
    layers: int, ratio: float, head: float, n: int, m: int, mode: str
) -> None:
    costs = costs_of(layers, ratio, head)
    options = {"async_optimizer": mode != "sync", "loss_lag": int(mode == "lag1")}
    with native.pure_python():
        expected = choose_evaluated_plan(costs, n, m, None, **options)  # type: ignore[arg-type]
        evaluate = (late_loop_evaluator if mode == "lag1" else _evaluator(mode))(costs, n, m)
        expected_ms = evaluate(expected)
    assert choose_evaluated_plan(costs, n, m, None, **options) == expected  # type: ignore[arg-type]
    assert evaluate(expected) == expected_ms


def _evaluator(mode: str):  # type: ignore[no-untyped-def]
    return lambda costs, n, m: engine_evaluator(costs, n, m, async_optimizer=mode != "sync")


@needs_native
def test_the_compiled_loops_refuse_arrays_that_do_not_match() -> None:
    kernels = native.kernels()
    assert kernels is not None
    ints, floats = native.ints, native.floats
    with pytest.raises(ValueError, match="unequal lengths"):  # offsets one short
        kernels.list_schedule(
            floats([1.0]), ints([0, 0]), ints([0, 0]), ints([0, 0]), ints([]), ints([0, 0]), ints([]),
            ints([]), 1, floats([0.0]), math.inf, ints([]), math.inf, True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="out of range"):  # a task of a slot the plan lacks
        kernels.list_schedule(
            floats([1.0]), ints([0, 3]), ints([0, 0]), ints([0, 0, 0]), ints([]), ints([0, 0]), ints([]),
            ints([]), 1, floats([0.0]), math.inf, ints([]), math.inf, True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="out of range"):  # a dependency past the graph
        kernels.invert(ints([0, 1]), ints([5]))
    with pytest.raises(TypeError, match="items of 8 bytes"):  # a list of 4-byte ints
        kernels.invert(ints([0, 0]), native.array("i", []))
    # an empty graph replays to nothing, whatever the kept working blocks hold from before
    empty = kernels.replay(
        ints([]), ints([]), floats([]), ints([0]), ints([]), ints([]), ints([]), bytearray(0), ints([]),
        bytearray(0), 1, 1 << 20, False, 0, 0,
    )  # fmt: skip
    assert (list(empty[0]), empty[1], empty[2]) == ([], 0, -1.0)
    with pytest.raises(ValueError, match="power of two"):  # heap keys are read back with a mask
        kernels.replay(
            ints([]), ints([]), floats([]), ints([0]), ints([]), ints([]), ints([]), bytearray(0), ints([]),
            bytearray(0), 1, 3 << 19, False, 0, 0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="out of range"):  # a group past the offsets
        kernels.first_starts(floats([0.0]), ints([0, 1]), ints([0]), 2)
    with pytest.raises(ValueError, match="never started"):
        kernels.first_starts(floats([-1.0]), ints([0, 1]), ints([0]), 1)


@needs_native
def test_the_compiled_split_layout_is_the_python_layout() -> None:
    rng = random.Random(21)
    for _ in range(200):
        n, rounds = random_rounds(rng)
        s_count = rng.randint(1, 16)
        graph = SplitGraph(s_count, n, rounds)
        first_backward = rng.randint(1, s_count)
        after, unmet, saving, ready = graph.layout(first_backward)
        device, offsets, flat, packed_unmet, packed_saving = graph.packed_layout(first_backward)
        assert (list(device), list(packed_unmet), list(packed_saving)) == (graph.device, unmet, saving)
        assert (list(offsets), list(flat)) == tuple(map(list, native.csr(after)))
        # the compiled loop starts from the tasks with nothing unmet: the layout's ready ones
        assert [t for t, waits in enumerate(unmet) if not waits] == sorted(t for ts in ready for t in ts)


@needs_native
def test_the_compiled_policy_iteration_gives_the_python_period() -> None:
    rng = random.Random(1)
    for _ in range(1500):
        n = rng.choice([1, 2, 3, 4, 8])
        rounds = round_sizes(rng.choice([n, 2 * n, 3 * n + 1]), n)
        slots: list[float] = [
            rng.choice([0.0, 0.3, 1.0, 2.0, 3.7]) * rng.randint(1, 9) for _ in range(rng.randint(1, 24))
        ]
        lead = rng.choice([None, [rng.choice([0.0, 0.5]) * x for x in slots]])
        if rng.random() < 0.3:  # the steady search's: integer ticks of up to 2**44, no lead
            slots, lead = [rng.randint(0, 1 << rng.choice([4, 30, 44])) for _ in slots], None
        with native.pure_python():
            expected = steady_period(slots, n, rounds, lead)
        assert steady_period(slots, n, rounds, lead) == expected, (slots, n, rounds, lead)


@needs_native
def test_the_compiled_busiest_share_is_the_python_share() -> None:
    """`busiest_device_share` (every async candidate's floor): the same float, to the last bit,
    slot counts that do and do not divide the device count, uneven rounds included."""
    rng = random.Random(5)
    for _ in range(3000):
        n, rounds = random_rounds(rng)
        slots = tuple(
            rng.choice([0.0, 0.1, 0.3, 1.0, 2.7]) * rng.uniform(0.5, 3.0) for _ in range(rng.randint(0, 30))
        )
        with native.pure_python():
            expected = busiest_device_share(slots, n, rounds)
        assert busiest_device_share(slots, n, rounds) == expected, (slots, n, rounds)


@needs_native
def test_the_compiled_sharers_are_the_python_sharers() -> None:
    """`sharers_and_waits`: the pairs the chain walk finds, and (stages it does not walk: empty
    ones, chains that do not meet) those of comparing every pair, in the same order."""
    rng = random.Random(6)
    for _ in range(3000):
        layers = rng.randint(1, 30)
        p = rng.randint(0, layers - 1)
        fwd, bwd = (random_chain(rng, p), random_chain(rng, p)[::-1]) if p else ([], [])
        if rng.random() < 0.2 and fwd:  # an empty or overlapping stage: the pairwise path
            fwd[rng.randrange(len(fwd))] = rng.choice([range(0, 0), range(0, p)])
        fused = rng.choice([range(p, layers), range(p, layers), range(p, p)])
        with native.pure_python():
            expected = sharers_and_waits(fwd, fused, bwd)
        assert sharers_and_waits(fwd, fused, bwd) == expected, (fwd, fused, bwd)


@needs_native
def test_the_compiled_tick_bound_is_the_python_bound() -> None:
    """`steady_bound_ticks` (every candidate of the steady search): `steady_bound`'s float to the
    last bit on integer slot times of the ticks' size (up to 2**44), slot counts above, equal to
    and below the device count, one round size or several."""
    rng = random.Random(8)
    for _ in range(4000):
        n, rounds = random_rounds(rng)
        scale = rng.choice([1, 1000, 1 << 30, 1 << 40])
        slots = [rng.randint(0, scale) for _ in range(rng.randint(0, 3 * n + 2))]
        with native.pure_python():
            expected = steady_bound_ticks(slots, n, rounds)
        assert expected == steady_bound(slots, n, rounds)
        assert steady_bound_ticks(slots, n, rounds) == expected, (slots, n, rounds)


@needs_native
def test_the_compiled_even_split_is_the_python_split() -> None:
    """`_candidates.balanced_split` (a third of a choice's time before it was compiled): the same
    parts, memory caps, ties and both orders included, on random prefix sums."""
    rng = random.Random(3)
    for _ in range(4000):
        layers = rng.randint(1, 40)
        fwd = [rng.choice([0.0, 0.1, 0.5, 1.0, 1.0, 2.0, 3.3]) for _ in range(layers)]
        fwd[0] = fwd[0] or 1.0
        bwd = [x * rng.choice([1.3, 2.0, 3.0]) for x in fwd]
        mem = [rng.randint(0, 5) for _ in fwd]
        ticks = Ticks(*to_ticks(fwd, bwd), mem, rng.choice([None, max(mem) + rng.randint(0, 10)]))
        pre = rng.choice([ticks.fwd, ticks.fb])
        stop = rng.randint(0, layers)
        parts, larger_last = rng.randint(0, stop + 1), rng.random() < 0.5
        expected = balanced_split(pre, stop, parts, ticks.reach, larger_last=larger_last)
        packed = (native.ints(pre), native.ints(ticks.reach))
        assert balanced_split(packed[0], stop, parts, packed[1], larger_last=larger_last) == expected
