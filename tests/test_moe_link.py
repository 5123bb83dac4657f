"""Link-bound runs: link-aware layer costs, the bytes a plan uploads, and the plan chosen with the link on."""

from __future__ import annotations

import pytest

from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan, choose_plan, round_sizes
from roundpipe.plan.link import link_costs, link_report, upload_bytes, upload_ms
from roundpipe.planning.link_plan import choose_link_plan, link_iteration_ms
from roundpipe.planning.simulate import simulate
from roundpipe.sched.trace import Trace

LINK_GBPS = 1.0
MB20 = 20_000_000  # 20 ms per upload at 1 GB/s, against 3 ms of compute per microbatch


def uniform(layers: int) -> LayerCosts:
    return LayerCosts((1.0,) * layers, (2.0,) * layers, (100,) * layers)


def test_link_costs_raise_only_the_layers_whose_upload_outlasts_their_compute() -> None:
    costs = LayerCosts((1.0, 4.0, 1.0), (2.0, 8.0, 0.5), (0, 0, 0))
    out = link_costs(costs, [MB20, MB20, 2_000_000], LINK_GBPS, 4)  # u/M_R = 5, 5, 0.5 ms
    assert out.fwd_ms == pytest.approx((5.0, 5.0, 1.0))  # a forward slot: max(f, u/M_R)
    sums = [f + b for f, b in zip(out.fwd_ms, out.bwd_ms, strict=True)]
    assert sums == pytest.approx((5.0, 12.0, 1.5))  # backward / fused: max(f + b, u/M_R)
    assert upload_ms(MB20, LINK_GBPS) == pytest.approx(20.0)


def test_link_costs_refuse_mismatched_inputs() -> None:
    with pytest.raises(PlanError, match="param_bytes has 2 entries for 3 layers"):
        link_costs(uniform(3), [1, 2], LINK_GBPS, 1)
    with pytest.raises(PlanError, match="link_gbps must be a positive number"):
        link_costs(uniform(1), [1], 0.0, 1)


@pytest.mark.parametrize(("devices", "microbatches", "round_size"), [(1, 4, 4), (2, 4, 2), (2, 4, 4)])
def test_each_weight_crosses_the_link_once_per_slot_and_round(
    devices: int, microbatches: int, round_size: int
) -> None:
    """The engine's uploads are at the floor the report counts: a layer once per forward and
    once per backward slot per round, once per round in the fused stage."""
    costs = uniform(6)
    params = [MB20 + i for i in range(6)]
    plan = choose_plan(costs, devices, microbatches, 600, round_size=round_size)
    assert len(plan.fused) < costs.num_layers  # forward and backward slots too
    result = simulate(
        plan,
        costs,
        devices,
        microbatches,
        async_optimizer=False,
        link_gbps=LINK_GBPS,
        param_bytes=params,
        round_size=round_size,
    )
    moved = sum(task.nbytes for task in result.trace if task.kind == "param_up")
    rounds = round_sizes(microbatches, devices, round_size)
    assert moved == upload_bytes(plan, params, rounds)
    fused = sum(params[i] for i in plan.fused)
    assert moved == len(rounds) * (2 * sum(params) - fused)


def test_the_plan_chosen_with_the_link_on_is_faster_where_uploads_dominate() -> None:
    """One device, 12 link-bound layers, 3 layers a stage: the plan chosen on link-aware costs
    (a longer fused stage: fewer uploads) runs faster with the link on than the compute-only one."""
    costs, params = uniform(12), [MB20] * 12

    def make(c: LayerCosts) -> Plan:
        return choose_plan(c, 1, 4, 600, round_size=4)

    choice = choose_link_plan(make, costs, params, LINK_GBPS, 1, 4, async_optimizer=False, round_size=4)
    assert choice.iteration_ms < choice.compute_only_ms * 0.95
    assert choice.plan != make(costs)
    assert len(choice.plan.fused) > len(make(costs).fused)
    report = choice.report
    assert report.link_bound and report.link_ms > report.compute_ms
    assert report.link_bound_layers == tuple(range(12))
    assert "link-bound" in report.describe() and report.to_dict()["link_bound"] is True


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_link_choice_is_never_slower_and_compute_bound_runs_keep_their_plan(asynchronous: bool) -> None:
    costs = uniform(10)

    def make(c: LayerCosts) -> Plan:
        return choose_plan(c, 2, 4, None, round_size=4, async_optimizer=asynchronous)

    heavy = choose_link_plan(
        make, costs, [MB20] * 10, LINK_GBPS, 2, 4, async_optimizer=asynchronous, round_size=4
    )
    assert heavy.iteration_ms <= heavy.compute_only_ms
    light = choose_link_plan(
        make, costs, [1000] * 10, LINK_GBPS, 2, 4, async_optimizer=asynchronous, round_size=4
    )
    assert light.plan == make(costs) and not light.report.link_bound
    assert light.iteration_ms == pytest.approx(
        link_iteration_ms(
            light.plan, costs, [1000] * 10, LINK_GBPS, 4, async_optimizer=asynchronous, round_size=4
        )
    )


def test_link_report_says_how_many_microbatches_hide_the_uploads() -> None:
    costs, params = uniform(4), [MB20] * 4
    plan = choose_plan(costs, 1, 4, None, round_size=4)
    short = link_report(plan, costs, params, LINK_GBPS, (4,))
    assert short.link_bound
    enough = link_report(plan, costs, params, LINK_GBPS, (short.hiding_microbatches,))
    assert not enough.link_bound
    fewer = link_report(plan, costs, params, LINK_GBPS, (short.hiding_microbatches - 1,))
    assert fewer.link_bound


def test_the_replan_takes_the_link_aware_plan_where_the_measured_link_makes_it_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`with_link` (the CUDA re-plan): the link measured from the trace's weight uploads, the
    plan made on link-aware costs within the same memory budget, kept where it runs faster. On
    one device the evaluated choice ("balanced"): the default coarse plan there is the memory's
    own, the same on any costs."""
    import roundpipe
    from roundpipe.plan.memory import LayerMemory, layer_plan_bytes
    from roundpipe.planning import device_plan
    from roundpipe.planning.device_plan import plan_from
    from roundpipe.planning.link_refine import with_link

    monkeypatch.setattr(device_plan, "STAGES_ON_ONE_DEVICE", "balanced")
    from roundpipe.planning.measured import measured_link_gbps

    mb, layers = 10**6, 12
    mem = LayerMemory(
        param_bytes=(20 * mb,) * layers,
        grad_bytes=(0,) * layers,  # frozen (LoRA elsewhere): no gradient to hold or download
        saved_bytes=(10 * mb,) * layers,
        work_bytes=(5 * mb,) * layers,
        boundary_bytes=(mb,) * layers,
    )
    costs = LayerCosts((1.0,) * layers, (2.0,) * layers, layer_plan_bytes(mem))
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, async_optimizer=False, round_size=4)
    budget = 200 * mb
    first = plan_from(config, costs, mem, 1, budget, kind="cpu")

    def run(params: int) -> Trace:
        return simulate(
            first.plan,
            costs,
            1,
            4,
            iterations=2,
            async_optimizer=False,
            link_gbps=LINK_GBPS,
            param_bytes=[params] * layers,
            round_size=4,
        ).trace

    heavy = run(20 * mb)
    assert measured_link_gbps(heavy) == pytest.approx(LINK_GBPS)
    chosen = with_link(first, config, heavy, (20 * mb,) * layers)
    assert chosen.plan != first.plan and chosen.costs is first.costs
    assert chosen.prediction.fits(budget)
    assert chosen.link is not None and chosen.link.link_bound

    def timed(plan: Plan) -> float:
        return link_iteration_ms(
            plan, costs, [20 * mb] * layers, LINK_GBPS, 4, async_optimizer=False, round_size=4
        )

    assert timed(chosen.plan) < timed(first.plan)
    light = with_link(first, config, run(1000), (1000,) * layers)
    assert light.plan == first.plan and light.link is not None and not light.link.link_bound
    # Uploads that hide behind compute keep one stage ahead (`with_prefetch` is not consulted).
    assert not light.link.link_bound_layers and light.prediction.prefetch == 1
