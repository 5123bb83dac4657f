"""Layer costs, plans and the partitioner: validation, JSON, invariants, and optimality against brute force."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan, Slot, objective, partition

# ---------------------------------------------------------------------------- helpers


def quarter(hi: int) -> st.SearchStrategy[float]:
    """Multiples of 1/4: exact in binary, so float sums tie exactly and brute force is exact too."""
    return st.integers(0, hi).map(lambda x: x / 4)


@st.composite
def small_cases(draw: st.DrawFn, max_layers: int = 7) -> tuple[LayerCosts, int, int, int | None, bool]:
    n = draw(st.integers(1, max_layers))
    fwd = draw(st.lists(quarter(12), min_size=n, max_size=n))
    bwd = draw(st.lists(quarter(24), min_size=n, max_size=n))
    mem = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    limit = draw(st.one_of(st.none(), st.integers(2 * max(mem) if max(mem) else 1, 2 * max(mem) + 24)))
    devices = draw(st.integers(1, 5))
    microbatches = draw(st.integers(1, 9))
    return LayerCosts(fwd, bwd, mem), devices, microbatches, limit, draw(st.booleans())


def compositions(n: int) -> Iterator[list[range]]:
    """Every split of layers [0, n) into consecutive non-empty stages, shallow first."""
    if n == 0:
        yield []
        return
    for mask in range(1 << (n - 1)):
        cuts = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        yield [range(a, b) for a, b in itertools.pairwise(cuts)]


def brute_force(
    costs: LayerCosts, devices: int, microbatches: int, limit: int | None, async_optimizer: bool
) -> tuple[float, int, int]:
    """(objective, slots, fused start) of the best plan over ALL valid plans, with the same rule:
    each stage's memory <= limit // 2; ties to fewer slots, then to a longer fused stage."""
    n = costs.num_layers
    cap = None if limit is None else limit // 2

    def fits(stages: list[range]) -> bool:
        return cap is None or all(costs.stage_mem(r) <= cap for r in stages)

    best: tuple[float, int, int] | None = None
    for p in range(n):
        fused = range(p, n)
        if not fits([fused]):
            continue
        fwd_options = [
            (s, max([costs.fwd_stage_ms(r) for r in s], default=0.0)) for s in compositions(p) if fits(s)
        ]
        bwd_options = [
            (s, max([costs.bwd_stage_ms(r) for r in s], default=0.0)) for s in compositions(p) if fits(s)
        ]
        for fs, tf in fwd_options:
            for bs, tb in bwd_options:
                t = max(tf, tb, costs.fused_stage_ms(fused))
                slots = len(fs) + 1 + len(bs)
                key = (
                    objective((slots, t), devices, microbatches, async_optimizer=async_optimizer),
                    slots,
                    p,
                )
                if best is None or key < best:
                    best = key
    assert best is not None
    return best


def check_plan(plan: Plan, costs: LayerCosts, limit: int | None) -> None:
    """Coverage, order, stage bounds, memory and t_max of any plan partition() returns."""
    n = costs.num_layers
    assert plan.num_layers == n and plan.fused.stop == n and len(plan.fused) >= 1
    fwd_layers = [i for r in plan.fwd_stages for i in r] + list(plan.fused)
    bwd_layers = [i for r in reversed(plan.bwd_stages) for i in r] + list(plan.fused)
    assert fwd_layers == list(range(n))
    assert bwd_layers == list(range(n))
    times = plan.stage_ms(costs)
    assert plan.t_max == max(times)
    assert all(t <= plan.t_max for t in times)
    assert plan.slot_ms == times
    if limit is not None:
        assert all(costs.stage_mem(s.layers) <= limit // 2 for s in plan.slots)
    names = [s.name for s in plan.slots]
    k, b = len(plan.fwd_stages), len(plan.bwd_stages)
    assert names == [f"F{i}" for i in range(1, k + 1)] + ["FB"] + [f"B{j}" for j in range(b, 0, -1)]
    assert [s.index for s in plan.slots] == list(range(plan.num_slots))


def realistic(decoders: int, seed: int = 0) -> LayerCosts:
    """An embedding (cheap), noisy identical decoder layers, an LM head 3.5x a layer."""
    import random

    rng = random.Random(seed)
    fwd = [0.05] + [1.0 + rng.uniform(-0.03, 0.03) for _ in range(decoders)] + [3.5]
    bwd = [0.1] + [2.0 + rng.uniform(-0.06, 0.06) for _ in range(decoders)] + [7.0]
    mem = [500] + [1000 + rng.randint(-20, 20) for _ in range(decoders)] + [3500]
    names = ["embed"] + [f"layers.{i}" for i in range(decoders)] + ["lm_head"]
    return LayerCosts(fwd, bwd, mem, names)


# ---------------------------------------------------------------------------- Plan


def test_from_stages_builds_a_checked_plan() -> None:
    costs = LayerCosts.uniform(6, head_factor=2.0, mem_bytes=1)
    plan = Plan.from_stages(
        [range(0, 3), [3, 5]], range(5, 6), [range(3, 5), range(1, 3), range(0, 1)], costs, 2, 4
    )
    assert plan.fwd_stages == (range(0, 3), range(3, 5))
    assert plan.slot_ms == (3.0, 2.0, 6.0, 6.0, 6.0, 3.0)
    assert plan.t_max == 6.0 and plan.num_slots == 6 and plan.num_layers == 6
    assert [s.name for s in plan.slots] == ["F1", "F2", "FB", "B3", "B2", "B1"]
    assert plan.slots[-1] == Slot(5, "bwd", range(0, 1), 1)
    assert plan.bwd_boundaries == frozenset({0, 1, 3, 5})
    text = str(plan)
    assert "FB" in text and "fused" in text and "3-4" in text and "B1" in text


@pytest.mark.parametrize(
    ("fwd", "fused", "bwd", "message"),
    [
        (
            [range(0, 2)],
            range(3, 4),
            [range(0, 3)],
            r"fwd_stages cover layers \[0, 2\) but must cover \[0, 3\)",
        ),
        (
            [range(0, 2), range(1, 3)],
            range(3, 4),
            [range(0, 3)],
            r"fwd_stages\[1\] = \[1, 3\) should start at layer 2",
        ),
        (
            [range(0, 3)],
            range(3, 4),
            [range(0, 1), range(1, 3)],
            r"bwd_stages\[1\] = \[1, 3\) should start at layer 0.*deepest stage first",
        ),
        ([range(0, 3), range(3, 3)], range(3, 4), [range(0, 3)], r"fwd_stages\[1\] = range\(3, 3\) is empty"),
        (
            [range(0, 3)],
            range(3, 3),
            [range(0, 3)],
            r"must hold the deepest layers, i.e. stop at 4",
        ),
        (
            [range(0, 2)],
            range(2, 3),
            [range(0, 2)],
            r"fused stage range\(2, 3\) must hold the deepest layers, i.e. stop at 4",
        ),
        ([range(0, 3, 2)], range(3, 4), [range(0, 3)], r"step 1"),
    ],
)
def test_from_stages_rejects_bad_shapes(
    fwd: list[range], fused: range, bwd: list[range], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        Plan.from_stages(fwd, fused, bwd, LayerCosts.uniform(4), 2, 4)


def test_from_stages_checks_memory_when_asked() -> None:
    costs = LayerCosts.uniform(4, mem_bytes=10)
    with pytest.raises(
        PlanError, match=r"stage F1 \(layers 0-2\) needs 30 bytes, over the per-stage cap 25 bytes"
    ):
        Plan.from_stages([range(0, 3)], range(3, 4), [range(0, 3)], costs, 2, 4, mem_limit_bytes=50)


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = partition(realistic(20), 4, 8, mem_limit_bytes=12_000)
    plan.to_json(tmp_path / "plan.json")
    assert Plan.from_json(tmp_path / "plan.json") == plan
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["fused"] == [plan.fused.start, plan.fused.stop]
    assert Plan.from_dict(data) == plan
    bare = {k: v for k, v in data.items() if k != "slot_ms"}
    assert Plan.from_dict(bare).slot_ms == ()
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['extra'\]"):
        Plan.from_dict({**data, "extra": 1})


def test_objective_formulas() -> None:
    assert objective((10, 2.0), 4, 8) == (8 * 10 + 4 * 3) * 2.0
    assert objective((10, 2.0), 4, 8, async_optimizer=True) == 8 * 10 * 2.0
    assert objective((2, 2.0), 4, 8, async_optimizer=True) == 8 * 4 * 2.0
    plan = partition(LayerCosts.uniform(5), 2, 3)
    assert objective(plan, 2, 3) == (3 * plan.num_slots + 2) * plan.t_max


# ---------------------------------------------------------------------------- partition


@pytest.mark.parametrize(
    ("devices", "microbatches", "message"),
    [
        (0, 4, r"num_devices must be an integer >= 1, got 0"),
        (2, 0, r"num_microbatches must be an integer >= 1, got 0"),
        (-1, 4, r"num_devices .* got -1"),
        (True, 4, r"num_devices .* got True"),
    ],
)
def test_partition_rejects_bad_counts(devices: int, microbatches: int, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        partition(LayerCosts.uniform(4), devices, microbatches)


def test_partition_names_a_layer_that_cannot_fit() -> None:
    costs = LayerCosts([1, 1, 1, 3.5], [2, 2, 2, 7], [10, 10, 10, 100], ["embed", "h.0", "h.1", "lm_head"])
    with pytest.raises(PlanError) as err:
        partition(costs, 2, 4, mem_limit_bytes=150)
    text = str(err.value)
    assert "layer 3 ('lm_head') needs 100 bytes" in text
    assert "mem_limit_bytes=150 bytes" in text and "at most 75 bytes" in text
    assert "microbatch" in text and "recompute grain 'layer'" in text and "more memory" in text
    with pytest.raises(PlanError, match="mem_limit_bytes must be a positive integer"):
        partition(costs, 2, 4, mem_limit_bytes=0)


def test_everything_fused_when_it_is_best() -> None:
    plan = partition(LayerCosts.uniform(3), 1, 4)  # one device: no fill/drain, recompute only costs
    assert plan.fwd_stages == () and plan.bwd_stages == () and plan.fused == range(0, 3)
    assert plan.num_slots == 1 and plan.bwd_boundaries == frozenset({0})


def test_single_layer() -> None:
    plan = partition(LayerCosts([2.0], [3.0], [7]), 8, 16, mem_limit_bytes=14)
    assert plan.fused == range(0, 1) and plan.num_slots == 1 and plan.t_max == 5.0


def test_paper_style_example() -> None:
    """12 decoder layers + a heavy head on 4 devices: forward stages hold ~3x the layers of backward ones."""
    costs = LayerCosts([1.0] * 12 + [3.0], [2.0] * 12 + [6.0], [0] * 13)
    plan = partition(costs, 4, 8)
    check_plan(plan, costs, None)
    assert plan.fused == range(12, 13)
    assert plan.t_max == 9.0
    assert all(len(r) == 9 or r.start == 9 for r in plan.fwd_stages)
    assert all(len(r) == 3 for r in plan.bwd_stages)


@settings(max_examples=250, derandomize=True, deadline=None)
@given(small_cases())
def test_partition_is_optimal_against_brute_force(
    case: tuple[LayerCosts, int, int, int | None, bool],
) -> None:
    costs, devices, microbatches, limit, async_optimizer = case
    plan = partition(costs, devices, microbatches, limit, async_optimizer=async_optimizer)
    check_plan(plan, costs, limit)
    best, slots, fused_start = brute_force(costs, devices, microbatches, limit, async_optimizer)
    assert objective(plan, devices, microbatches, async_optimizer=async_optimizer) == best
    assert (plan.num_slots, plan.fused.start) == (slots, fused_start)  # tie-breaks agree too


@st.composite
def larger_cases(draw: st.DrawFn) -> tuple[LayerCosts, int, int, int | None, bool]:
    n = draw(st.integers(1, 60))
    fwd = draw(st.lists(quarter(40), min_size=n, max_size=n))
    bwd = draw(st.lists(quarter(80), min_size=n, max_size=n))
    mem = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    limit = draw(st.one_of(st.none(), st.integers(max(1, 2 * max(mem)), 2 * max(mem) + 400)))
    return (
        LayerCosts(fwd, bwd, mem),
        draw(st.integers(1, 8)),
        draw(st.integers(1, 32)),
        limit,
        draw(st.booleans()),
    )


@settings(max_examples=120, derandomize=True, deadline=None)
@given(larger_cases())
def test_partition_invariants_and_full_fused_stage(
    case: tuple[LayerCosts, int, int, int | None, bool],
) -> None:
    costs, devices, microbatches, limit, async_optimizer = case
    plan = partition(costs, devices, microbatches, limit, async_optimizer=async_optimizer)
    check_plan(plan, costs, limit)
    p = plan.fused.start
    if p > 0:  # the fused stage was filled first: one more layer breaks t_max or memory
        grown = range(p - 1, costs.num_layers)
        assert costs.fused_stage_ms(grown) > plan.t_max or (
            limit is not None and costs.stage_mem(grown) > limit // 2
        )
    # deterministic
    assert plan == partition(costs, devices, microbatches, limit, async_optimizer=async_optimizer)


def test_realistic_model_is_balanced_and_fast() -> None:
    costs = realistic(93)
    start = time.perf_counter()
    plan = partition(costs, 8, 16, mem_limit_bytes=14_000)
    elapsed = time.perf_counter() - start
    check_plan(plan, costs, 14_000)
    assert plan.fused == range(94, 95)  # the LM head alone: it is already a backward stage's worth
    assert plan.t_max >= 10.5 and elapsed < 0.5  # generous: the benchmark holds the real target
    big = realistic(998, seed=1)
    start = time.perf_counter()
    check_plan(partition(big, 8, 16, mem_limit_bytes=14_000), big, 14_000)
    assert time.perf_counter() - start < 5.0


def test_async_drops_the_fill_drain_term() -> None:
    costs = realistic(30)
    sync = partition(costs, 8, 16)
    steady = partition(costs, 8, 16, async_optimizer=True)
    check_plan(steady, costs, None)
    assert steady.num_slots >= 8
    assert objective(steady, 8, 16, async_optimizer=True) <= objective(sync, 8, 16, async_optimizer=True)
    assert objective(sync, 8, 16) <= objective(steady, 8, 16)
