"""Round-robin dispatch: round sizes, device of each slot, g0 carried across rounds and iterations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan, SlotRun, analytic_bubble, dispatch, partition, round_sizes


def make_plan(fwd: int, bwd: int) -> Plan:
    """A plan of ``fwd`` forward stages, the fused stage and ``bwd`` backward stages over one-layer stages."""
    layers = max(fwd, bwd)
    costs = LayerCosts.uniform(layers + 1)
    per = -(-layers // fwd) if fwd else 0
    fwd_stages = [range(i, min(i + per, layers)) for i in range(0, layers, per)] if fwd else []
    step = -(-layers // bwd) if bwd else 0
    bwd_stages = [range(i, min(i + step, layers)) for i in range(0, layers, step)][::-1] if bwd else []
    return Plan.from_stages(fwd_stages, range(layers, layers + 1), bwd_stages, costs, 4, 8)


@pytest.mark.parametrize(
    ("microbatches", "devices", "round_size", "expected"),
    [
        (4, 4, None, (4,)),
        (7, 4, None, (7,)),  # M < 2N: one round
        (8, 4, None, (4, 4)),
        (11, 4, None, (4, 7)),  # the remainder 3 < N joins the last round
        (3, 4, None, (3,)),  # M < N: one (short) round, the best there is
        (1, 1, None, (1,)),
        (16, 8, None, (8, 8)),
        (14, 4, 5, (5, 5, 4)),  # a smaller last round of >= N stays
        (13, 4, 5, (5, 8)),
        (6, 4, 8, (6,)),
        (12, 4, 4, (4, 4, 4)),
    ],
)
def test_round_sizes(
    microbatches: int, devices: int, round_size: int | None, expected: tuple[int, ...]
) -> None:
    assert round_sizes(microbatches, devices, round_size) == expected


def test_round_size_below_devices_is_refused() -> None:
    with pytest.raises(
        PlanError, match=r"round_size 3 is smaller than num_devices 4.*M_R >= N.*round_size >= 4"
    ):
        round_sizes(16, 4, 3)
    with pytest.raises(PlanError, match=r"num_microbatches must be an integer >= 1, got 0"):
        round_sizes(0, 4)
    with pytest.raises(PlanError, match=r"num_devices must be an integer >= 1, got 0"):
        round_sizes(4, 0)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.integers(1, 200), st.integers(1, 16), st.one_of(st.none(), st.integers(0, 40)))
def test_round_sizes_cover_all_microbatches(microbatches: int, devices: int, extra: int | None) -> None:
    size = None if extra is None else devices + extra
    rounds = round_sizes(microbatches, devices, size)
    assert sum(rounds) == microbatches
    assert all(r >= min(devices, microbatches) for r in rounds)
    if len(rounds) > 1:
        assert all(r >= devices for r in rounds)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    st.integers(0, 6),
    st.integers(0, 6),
    st.integers(1, 40),
    st.integers(1, 9),
    st.data(),
)
def test_dispatch_is_round_robin_across_rounds_and_iterations(
    fwd: int, bwd: int, microbatches: int, devices: int, data: st.DataObject
) -> None:
    if (fwd == 0) != (bwd == 0):
        bwd = fwd = max(fwd, bwd)
    plan = make_plan(fwd, bwd)
    g0 = data.draw(st.integers(0, devices - 1))
    stream: list[SlotRun] = []
    first = g0
    for it in range(3):
        runs, nxt = dispatch(plan, microbatches, devices, iteration=it, first_device=first)
        rounds = round_sizes(microbatches, devices)
        assert len(runs) == len(rounds) * plan.num_slots
        # slot i of round r on (g0_r + i) mod N, and g0_{r+1} = g0_r + S
        start_of_round = first
        for r, size in enumerate(rounds):
            chunk = runs[r * plan.num_slots : (r + 1) * plan.num_slots]
            assert [run.slot for run in chunk] == list(plan.slots)
            assert all(run.round == r and run.iteration == it for run in chunk)
            assert [run.device for run in chunk] == [
                (start_of_round + i) % devices for i in range(plan.num_slots)
            ]
            assert len({run.microbatches for run in chunk}) == 1 and len(chunk[0].microbatches) == size
            start_of_round = (start_of_round + plan.num_slots) % devices
        assert nxt == start_of_round
        covered = [mb for r in range(len(rounds)) for mb in runs[r * plan.num_slots].microbatches]
        assert covered == list(range(microbatches))
        stream += runs
        first = nxt
    # over rounds and iterations the devices simply keep counting: the stream never breaks
    assert [run.device for run in stream] == [(g0 + k) % devices for k in range(len(stream))]


def test_dispatch_example_and_round_size() -> None:
    plan = make_plan(2, 3)  # F1 F2 FB B3 B2 B1
    runs, nxt = dispatch(plan, 8, 4, first_device=1, round_size=4)
    assert [(run.round, run.slot.name, run.device) for run in runs[:7]] == [
        (0, "F1", 1), (0, "F2", 2), (0, "FB", 3), (0, "B3", 0), (0, "B2", 1), (0, "B1", 2),
        (1, "F1", 3),
    ]  # fmt: skip
    assert runs[6].microbatches == range(4, 8)
    assert nxt == (1 + 2 * 6) % 4
    with pytest.raises(PlanError, match=r"first_device must be a device index in 0\.\.3, got 4"):
        dispatch(plan, 8, 4, first_device=4)
    with pytest.raises(PlanError, match=r"round_size 2 is smaller than num_devices 4"):
        dispatch(plan, 8, 4, round_size=2)


def test_dispatch_of_a_partitioned_plan() -> None:
    plan = partition(LayerCosts.uniform(10, head_factor=3.0), 3, 6)
    runs, nxt = dispatch(plan, 6, 3)
    assert [run.slot.index for run in runs] == list(range(plan.num_slots)) * 2
    assert nxt == (2 * plan.num_slots) % 3


def test_analytic_bubble() -> None:
    assert analytic_bubble(4, 8, 13) == pytest.approx(12 / (104 + 12))
    assert analytic_bubble(8, 16, 40) == pytest.approx(56 / (640 + 56))
    assert analytic_bubble(1, 4, 3) == 0.0
    with pytest.raises(PlanError, match=r"num_slots must be an integer >= 1, got 0"):
        analytic_bubble(4, 8, 0)
