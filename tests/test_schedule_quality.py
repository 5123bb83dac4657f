"""Schedule quality: the bubbles the real engine gives on the fake backend stay where the design says.

Deterministic (virtual clock, no jitter) and fast. Profiles are shaped like real LLMs: a cheap
embedding, uniform decoder layers (1 ms forward, 2 ms backward) and an LM head 3.5x a layer, on 8
devices with 16 microbatches. `bench/schedule.py` prints the same figures for more cases.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from roundpipe.plan import LayerCosts, Plan, analytic_bubble, choose_plan, partition
from roundpipe.plan._candidates import balanced_split
from roundpipe.plan._steady import steady_bound, steady_period
from roundpipe.plan.dispatch import round_sizes, steady_iteration_ms
from roundpipe.planning.simulate import simulate

N, M = 8, 16
ASYNC_TARGET = 0.045  # steady-state bubble of the async optimizer


def llm(decoders: int, head: float = 3.5) -> LayerCosts:
    fwd = [0.05] + [1.0] * decoders + [head]
    bwd = [0.1] + [2.0] * decoders + [2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def uniform_plan(layers: int, devices: int, microbatches: int) -> tuple[LayerCosts, Plan]:
    """Every slot 3 ms: forward stages of 3 layers, backward and fused stages of 1 (bwd = 2 fwd)."""
    costs = LayerCosts.uniform(layers)
    p = layers - 1
    fwd = [range(i, min(i + 3, p)) for i in range(0, p, 3)]
    bwd = [range(i, i + 1) for i in range(p)][::-1]
    return costs, Plan.from_stages(fwd, range(p, layers), bwd, costs, devices, microbatches)


@pytest.mark.parametrize("decoders", [28, 32, 64])
def test_async_steady_bubble_of_llm_profiles_is_under_target(decoders: int) -> None:
    costs = llm(decoders)
    plan = choose_plan(costs, N, M, async_optimizer=True)  # what RoundPipe and the CLI run
    result = simulate(plan, costs, N, M, iterations=6, async_optimizer=True)
    assert result.steady_bubble_ratio is not None
    assert result.steady_bubble_ratio < ASYNC_TARGET, plan


def test_steady_plan_beats_the_t_max_objective_where_it_stalls() -> None:
    """28 decoders: counting every slot at t_max picks 11 slots whose rounds stall (about 9%)."""
    costs = llm(28)
    bound = partition(costs, N, M, async_optimizer=True)
    steady = partition(costs, N, M, async_optimizer=True, steady=True)
    runs = {
        name: simulate(plan, costs, N, M, iterations=6, async_optimizer=True)
        for name, plan in (("bound", bound), ("steady", steady))
    }
    bubbles = {name: run.steady_bubble_ratio for name, run in runs.items()}
    assert bubbles["bound"] is not None and bubbles["bound"] > 0.07
    assert bubbles["steady"] is not None and bubbles["steady"] < ASYNC_TARGET
    assert runs["steady"].makespan_ms < runs["bound"].makespan_ms


@pytest.mark.parametrize("decoders", [28, 32])
def test_steady_model_matches_the_engine(decoders: int) -> None:
    """The planner's model of the stream predicts the engine's settled iteration time within 2%."""
    costs = llm(decoders)
    plan = partition(costs, N, M, async_optimizer=True, steady=True)
    iterations = 12
    result = simulate(plan, costs, N, M, iterations=iterations, async_optimizer=True)
    starts = [
        min(t.start_t for t in result.trace if t.kind == "compute" and t.iteration == i)
        for i in range(iterations)
    ]
    measured = (starts[-1] - starts[6]) / (iterations - 1 - 6)
    assert steady_iteration_ms(plan, M, N) == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize(
    ("layers", "devices", "microbatches"), [(13, 4, 8), (13, 4, 16), (25, 8, 16), (16, 2, 4), (10, 3, 6)]
)
def test_sync_with_uniform_stages_matches_the_formula(layers: int, devices: int, microbatches: int) -> None:
    costs, plan = uniform_plan(layers, devices, microbatches)
    assert set(plan.slot_ms) == {3.0}
    result = simulate(plan, costs, devices, microbatches, iterations=2, async_optimizer=False)
    expected = analytic_bubble(devices, microbatches, plan.num_slots)
    assert result.bubble_ratio == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(("layers", "devices", "microbatches"), [(13, 4, 8), (25, 8, 16), (16, 2, 4)])
def test_async_with_uniform_stages_has_no_steady_bubble(layers: int, devices: int, microbatches: int) -> None:
    costs, plan = uniform_plan(layers, devices, microbatches)
    result = simulate(plan, costs, devices, microbatches, iterations=8, async_optimizer=True)
    assert result.steady_bubble_ratio is not None
    assert result.steady_bubble_ratio < 1e-9
    period = steady_iteration_ms(plan, microbatches, devices)
    assert period == pytest.approx(microbatches * sum(plan.slot_ms) / devices)  # the work bound


@pytest.mark.parametrize("decoders", [28, 32, 64])
def test_sync_bubble_within_formula_and_imbalance(decoders: int) -> None:
    """The sync bubble is at most the balanced formula plus what unequal stages add."""
    costs = llm(decoders)
    plan = partition(costs, N, M)
    result = simulate(plan, costs, N, M, iterations=1, async_optimizer=False)
    imbalance = 1 - (sum(plan.slot_ms) / plan.num_slots) / plan.t_max
    bound = 1 - (1 - analytic_bubble(N, M, plan.num_slots)) * (1 - imbalance)
    assert result.bubble_ratio <= bound + 1e-9


def test_steady_needs_the_async_optimizer_and_respects_memory() -> None:
    costs = LayerCosts((0.05, *[1.0] * 20, 3.5), (0.1, *[2.0] * 20, 7.0), (5, *[10] * 20, 35))
    with pytest.raises(ValueError, match="steady=True"):
        partition(costs, N, M, steady=True)
    plan = partition(costs, N, M, 100, async_optimizer=True, steady=True)
    assert all(costs.stage_mem(s.layers) <= 50 for s in plan.slots)


def test_balanced_split_is_min_max_and_orders_sizes() -> None:
    rng = random.Random(7)
    for _ in range(300):
        count = rng.randint(1, 8)
        weights = [rng.randint(1, 9) for _ in range(count)]
        pre = [0, *itertools.accumulate(weights)]
        parts = rng.randint(1, count)
        best = min(
            max(pre[b] - pre[a] for a, b in itertools.pairwise((0, *cuts, count)))
            for cuts in itertools.combinations(range(1, count), parts - 1)
        )
        for larger_last in (False, True):
            split = balanced_split(pre, count, parts, [count] * (count + 1), larger_last=larger_last)
            assert split is not None and len(split) == parts
            assert [i for r in split for i in r] == list(range(count))
            assert max(pre[r.stop] - pre[r.start] for r in split) == best
    pre = [0, *itertools.accumulate([3] * 32)]
    sizes = [len(r) for r in balanced_split(pre, 32, 10, [32] * 33) or []]
    assert sizes == [4, 4] + [3] * 8
    sizes = [len(r) for r in balanced_split(pre, 32, 10, [32] * 33, larger_last=True) or []]
    assert sizes == [3] * 8 + [4, 4]


def test_steady_bound_is_a_lower_bound_and_exact_when_slots_equal_devices() -> None:
    rng = random.Random(3)
    for _ in range(200):
        slots = [rng.uniform(1, 20) for _ in range(rng.randint(1, 20))]
        devices = rng.randint(1, 9)
        rounds = round_sizes(rng.randint(1, 30), devices)
        rounds = rounds[:1] if len(set(rounds)) == 1 else rounds
        assert steady_bound(slots, devices, rounds) <= steady_period(slots, devices, rounds) * (1 + 1e-9)
    slots = [10.0, 12.0, 9.0, 11.0]  # S = N: each device always runs the same slot
    assert steady_period(slots, 4, (4,)) == pytest.approx(4 * 12.0)
    assert math.isclose(steady_bound(slots, 4, (4,)), 4 * 12.0)
