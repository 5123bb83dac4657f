"""One device's coarse stages cut evenly where the fake engine with the link finds it faster.

The greedy coarse cut leaves the remainder in the last stage of each direction; with uploads
about as long as a layer's compute (a mixture of experts at 16 microbatches), a short stage before
a long one leaves the long one's upload exposed. `evenly_cut` keeps the counts and spreads the
layers; `even_cut` offers it where it is faster on the fake engine and fits the budget, and
`with_link` takes it for one device's coarse plans.
The costs are those of Qwen3-30B-A3B at 16 x 4,096 tokens on an H100, the plan the one that ran
there. Deterministic: the fake engine's virtual clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import roundpipe
from roundpipe.errors import PlanError
from roundpipe.plan import LayerCosts, Plan
from roundpipe.plan.coarse import evenly_cut
from roundpipe.plan.memory import LayerMemory, predict_peak
from roundpipe.planning import even_stages
from roundpipe.planning.device_plan import DevicePlan, planning_budget
from roundpipe.planning.even_stages import EVEN_GAIN, _longest_fused, even_cut, fused_per_call
from roundpipe.planning.link_plan import link_iteration_ms

GB = 10**9
MICROBATCHES = 16
LINK_GBPS = 49.0
# Embedding, 48 decoder blocks (1.8 ms forward, 2.64 ms backward per microbatch, 1.26 GB of
# weights), LM head: the H100 run's recompute and compute lanes divided over its layers.
FWD = (0.05, *(1.8,) * 48, 5.0)
BWD = (0.05, *(2.64,) * 48, 5.0)
UPLOAD = (int(0.62 * GB), *(int(1.26 * GB),) * 48, int(0.62 * GB))
COSTS = LayerCosts(FWD, BWD, tuple(b + GB // 2 for b in UPLOAD))
LINK = (LINK_GBPS, UPLOAD)
BUDGET = planning_budget(26 << 30, "cuda")


def ranges(pairs: list[tuple[int, int]]) -> list[range]:
    return [range(a, b) for a, b in pairs]


def greedy_plan() -> Plan:
    """The coarse plan that ran: a one-layer forward stage before the fused stage, and a
    two-layer last backward stage."""
    fwd = ranges([(0, 7), (7, 13), (13, 19), (19, 25), (25, 31), (31, 37), (37, 43), (43, 44)])
    bwd = ranges([(38, 44), (32, 38), (26, 32), (20, 26), (14, 20), (8, 14), (2, 8), (0, 2)])
    return Plan.from_stages(fwd, range(44, 50), bwd, COSTS, 1, MICROBATCHES)


def memory() -> LayerMemory:
    n = COSTS.num_layers
    return LayerMemory(
        param_bytes=UPLOAD,
        grad_bytes=(1 << 20,) * n,
        saved_bytes=(256 << 20,) * n,
        work_bytes=(256 << 20,) * n,
        boundary_bytes=(16 << 20,) * n,
        bwd_work_bytes=(512 << 20,) * n,
        carried_bytes=(0,) * n,
    )


def device_plan(plan: Plan, budget_bytes: int | None) -> DevicePlan:
    prediction = predict_peak(plan, memory(), "stage", act_in_flight=2)
    return DevicePlan(plan, COSTS, memory(), prediction, budget_bytes, "cuda")


def config() -> roundpipe.RunConfig:
    return roundpipe.RunConfig(devices="cpu:1", num_microbatches=MICROBATCHES, round_size=MICROBATCHES)


def iteration_ms(plan: Plan) -> float:
    return link_iteration_ms(
        plan, COSTS, UPLOAD, LINK_GBPS, MICROBATCHES, async_optimizer=True, round_size=MICROBATCHES
    )


def test_an_even_cut_keeps_the_fused_stage_and_the_counts_and_spreads_the_layers() -> None:
    even = evenly_cut(greedy_plan(), COSTS)
    assert even.fused == range(44, 50)
    assert [len(s) for s in even.fwd_stages] == [6, 6, 6, 6, 5, 5, 5, 5]  # larger ones compute first
    assert [len(s) for s in even.bwd_stages] == [6, 6, 6, 6, 5, 5, 5, 5]
    assert even.fwd_stages[0].start == 0 and even.fwd_stages[-1].stop == 44
    assert even.bwd_stages[0].stop == 44 and even.bwd_stages[-1].start == 0
    assert evenly_cut(even, COSTS) == even


def test_the_fake_engine_with_the_link_times_the_even_cut_faster_and_it_is_offered() -> None:
    greedy = greedy_plan()
    greedy_ms, even_ms = iteration_ms(greedy), iteration_ms(evenly_cut(greedy, COSTS))
    assert even_ms < greedy_ms * (1 - 0.01)  # the remainder stages' exposed uploads, ~1.5%
    held = device_plan(greedy, 26 << 30)
    offered = even_cut(held, BUDGET, config(), LINK, greedy_ms)
    assert offered is not None
    # Cut evenly, its fused stage longer where that fits and is faster still (two layers here).
    start = offered.plan.fused.start
    assert start < greedy.fused.start and offered.plan == evenly_cut(greedy, COSTS, start)
    assert (
        offered.iteration_ms == pytest.approx(iteration_ms(offered.plan)) and offered.iteration_ms < even_ms
    )
    assert offered.prediction.fits(BUDGET) and offered.prediction.prefetch == held.prediction.prefetch
    longer = evenly_cut(greedy, COSTS, start - 1)  # where the search stopped: no fit, or no faster
    fits = predict_peak(longer, memory(), "stage", act_in_flight=2).fits(BUDGET)
    assert not fits or iteration_ms(longer) >= offered.iteration_ms


def test_a_cut_already_even_or_no_faster_or_over_the_budget_is_not_offered() -> None:
    greedy = greedy_plan()
    greedy_ms = iteration_ms(greedy)
    even = evenly_cut(greedy, COSTS)
    # Already even: offered only with a longer fused stage, where one fits the budget.
    exact = predict_peak(even, memory(), "stage", act_in_flight=2).peak_bytes
    assert even_cut(device_plan(even, 26 << 30), exact, config(), LINK, 1e9) is None
    offered = even_cut(device_plan(even, 26 << 30), BUDGET, config(), LINK, 1e9)
    assert offered is not None and offered.plan.fused.start < even.fused.start
    # No faster by EVEN_GAIN than what the plan in hand is said to take.
    best = even_cut(device_plan(greedy, 26 << 30), BUDGET, config(), LINK, greedy_ms)
    assert best is not None
    no_gain = best.iteration_ms / (1 - EVEN_GAIN / 2)
    assert even_cut(device_plan(greedy, 26 << 30), BUDGET, config(), LINK, no_gain) is None
    # A budget the even plan's predicted peak does not fit.
    assert (
        even_cut(device_plan(greedy, 4 << 30), planning_budget(4 << 30, "cuda"), config(), LINK, greedy_ms)
        is None
    )
    assert even_cut(device_plan(greedy, None), None, config(), LINK, greedy_ms) is not None  # no budget: any


def test_plans_of_several_devices_keep_their_stages() -> None:
    held = replace(device_plan(greedy_plan(), None), plan=replace(greedy_plan(), num_devices=2))
    assert even_cut(held, None, config(), LINK, 1e9) is None


def test_a_plan_made_by_hand_is_checked_when_cut_evenly() -> None:
    with pytest.raises(PlanError):
        evenly_cut(replace(greedy_plan(), fused=range(44, 49)), COSTS)  # the fused stage must end last


@pytest.mark.parametrize("stages", ["coarse", "balanced"])
def test_the_cuda_replan_takes_the_even_cut_for_coarse_stages_only(
    monkeypatch: pytest.MonkeyPatch, stages: str
) -> None:
    """`with_link` (the CUDA re-plan), with the link measured from a run's uploads and the
    greedy plan as its link choice: the coarse default ends evenly cut, "balanced" (the evaluated
    choice's stages) as chosen."""
    from roundpipe.plan.link import link_report
    from roundpipe.planning import device_plan as device_plans
    from roundpipe.planning import link_plan, link_refine
    from roundpipe.planning.simulate import simulate

    greedy = greedy_plan()
    greedy_ms = iteration_ms(greedy)
    report = link_report(greedy, COSTS, UPLOAD, LINK_GBPS, (MICROBATCHES,))
    choice = link_plan.LinkChoice(greedy, greedy_ms, greedy_ms, report)
    monkeypatch.setattr(link_plan, "choose_link_plan", lambda *args, **kwargs: choice)
    monkeypatch.setattr(device_plans, "STAGES_ON_ONE_DEVICE", stages)
    run = simulate(
        greedy,
        COSTS,
        1,
        MICROBATCHES,
        iterations=2,
        link_gbps=LINK_GBPS,
        param_bytes=list(UPLOAD),
        round_size=MICROBATCHES,
    )
    held = device_plan(greedy, 26 << 30)
    chosen = link_refine.with_link(held, config(), run.trace, UPLOAD)
    offered = even_cut(held, BUDGET, config(), LINK, greedy_ms)
    assert offered is not None
    assert chosen.plan == (offered.plan if stages == "coarse" else greedy)
    assert chosen.link == report


def test_the_coarsest_plan_that_fits_cut_evenly_beats_the_plan_that_ran() -> None:
    """Counted with a small-gradient stage's drain apart from the farthest upload, the coarsest
    plan that fits the budget has fewer, larger stages than the plan that ran (a longer fused
    stage: fewer layers recomputed), and cut evenly it is faster on the fake engine with the link."""
    from roundpipe.planning.device_plan import _coarse_within_budget

    found = _coarse_within_budget(COSTS, memory(), BUDGET, "stage", 2, MICROBATCHES)
    assert found is not None
    coarse, prediction = found
    assert prediction.fits(BUDGET) and coarse.num_slots < greedy_plan().num_slots
    assert len(coarse.fused) > len(greedy_plan().fused)
    even = evenly_cut(coarse, COSTS)
    assert predict_peak(even, memory(), "stage", act_in_flight=2).fits(BUDGET)
    assert iteration_ms(even) < iteration_ms(greedy_plan()) * (1 - EVEN_GAIN)


# Qwen3-32B shape at 4 x 4,096 tokens on one H100 (the measured 7.1 ms forward and 8.7 ms
# backward a layer and microbatch), its frozen base in 4 bits made dense once a run, planned as
# that run was: forward and backward stages of 7 layers, a fused stage of 7 (the LM head's too).
# Memory shaped like that run's (an activation set of ~1 GB a layer and microbatch).
E_FWD = (1.1, *(7.1,) * 64, 12.7)
E_BWD = (0.01, *(8.7,) * 64, 1.4)
E_COSTS = LayerCosts(E_FWD, E_BWD, (1,) * 66)
E_BUDGET = planning_budget(24 << 30, "cuda")


def e_memory(base: str) -> tuple[tuple[int, ...], LayerMemory]:
    """The uploaded bytes of each layer and its memory, with a 4-bit base (a quarter of the bytes
    uploaded, the dense copies held while a stage runs) or a bf16 one."""
    packed, dense = (int(0.276 * GB), int(0.97 * GB)) if base == "nf4" else (int(0.97 * GB), 0)
    mib = 1 << 20
    upload = (int(1.56 * GB), *(packed,) * 64, int(1.56 * GB))
    memory = LayerMemory(
        param_bytes=upload,
        grad_bytes=(0, *(4 * mib,) * 64, 0),
        saved_bytes=(0, *(int(0.45 * GB),) * 64, int(1.3 * GB)),
        work_bytes=(40 * mib, *(int(0.3 * GB),) * 64, int(2.5 * GB)),
        boundary_bytes=(mib, *(42 * mib,) * 64, 42 * mib),
        bwd_work_bytes=(0, *(int(0.4 * GB),) * 64, int(2.5 * GB)),
        carried_bytes=(mib,) * 66,
        dense_bytes=(0, *(dense,) * 64, 0),
        residual_bytes=(0, *(42 * mib,) * 64, 0),
    )
    return upload, memory


def e_plan() -> Plan:
    fwd = ranges([*[(7 * i, 7 * i + 7) for i in range(8)], (56, 59)])
    bwd = ranges([*[(59 - 7 * i - 7, 59 - 7 * i) for i in range(8)], (0, 3)])
    return Plan.from_stages(fwd, range(59, 66), bwd, E_COSTS, 1, 4)


E_LINK_GBPS = 53.9
E_CONFIG = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, round_size=4)


def e_held(base: str) -> tuple[DevicePlan, tuple[int, ...]]:
    """The device plan that ran (`e_plan`, predicted at layer_input) and each layer's uploaded bytes."""
    upload, memory = e_memory(base)
    plan = e_plan()
    prediction = predict_peak(plan, memory, "layer_input", act_in_flight=2)
    return DevicePlan(plan, E_COSTS, memory, prediction, 24 << 30, "cuda"), upload


def e_ms(cut: Plan, upload: tuple[int, ...], costs: LayerCosts = E_COSTS) -> float:
    """``cut``'s iteration on the fake engine with the link on, as `even_cut` times it."""
    return link_iteration_ms(cut, costs, upload, E_LINK_GBPS, 4, async_optimizer=True, round_size=4)


@pytest.mark.parametrize("base", ["nf4", "bf16"])
def test_the_fused_stage_grows_where_small_uploads_leave_room_for_it(base: str) -> None:
    """Every stage of the greedy cut has the same cap, half the limit, for a stage uploaded behind
    it as large as itself; a 4-bit base uploads a quarter of what a stage holds, so its fused stage
    was shorter than fits. Each layer more in it is one less recomputed: the even cut takes the
    longest fused stage that fits and is faster (two layers more here); with a bf16 base none
    longer fits."""
    held, upload = e_held(base)
    plan, memory, prediction = held.plan, held.memory, held.prediction
    held_ms = e_ms(plan, upload)
    longer = evenly_cut(plan, E_COSTS, plan.fused.start - 1)
    if base == "bf16":
        offered = even_cut(held, E_BUDGET, E_CONFIG, (E_LINK_GBPS, upload), held_ms)
        assert prediction.fits(E_BUDGET)
        assert not predict_peak(longer, memory, "layer_input", act_in_flight=2).fits(E_BUDGET)
        assert offered is not None and offered.plan.fused == plan.fused  # cut evenly, no longer
        assert offered.memory is memory  # no dense copies to leave out
        return
    # With its dense copies (the fused stage dequantizing in each call: the next test).
    offered = _longest_fused(held, E_BUDGET, E_CONFIG, (E_LINK_GBPS, upload), False, None)
    assert offered is not None and offered.memory is memory
    assert len(offered.plan.fused) == len(plan.fused) + 2 and offered.prediction.fits(E_BUDGET)
    assert offered.plan.num_slots == plan.num_slots
    assert offered.iteration_ms == pytest.approx(e_ms(offered.plan, upload))
    assert offered.iteration_ms < held_ms * (1 - EVEN_GAIN)
    # Each layer more saves its forward of 4 microbatches (28.4 ms) on the fake engine.
    assert e_ms(longer, upload) - e_ms(offered.plan, upload) == pytest.approx(4 * 7.1, rel=0.05)
    one_more = evenly_cut(plan, E_COSTS, offered.plan.fused.start - 1)
    assert not predict_peak(one_more, memory, "layer_input", act_in_flight=2).fits(E_BUDGET)


def test_a_fused_stage_that_dequantizes_in_each_call_holds_more_layers_and_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where runs hold dense copies of a 4-bit base, the fused stage may leave its own out: a
    quarter of the bytes a layer, so it takes more layers, each one forward of four microbatches
    less to recompute (28.4 ms) for eight dequantizations more (5.5 ms at 1,400 GB/s). The other
    runs keep their copies; the runtime follows the memory table the cut comes with. Where
    dequantizing is slow, or dequantize="run" asks for copies in every run, it keeps its copies."""
    held, upload = e_held("nf4")
    plan, memory = held.plan, held.memory
    link = (E_LINK_GBPS, upload)
    held_ms = e_ms(plan, upload)
    with_copies = _longest_fused(held, E_BUDGET, E_CONFIG, link, False, None)
    offered = even_cut(held, E_BUDGET, E_CONFIG, link, held_ms)
    assert with_copies is not None and offered is not None
    start = offered.plan.fused.start
    per_call_memory, per_call_costs = fused_per_call(memory, E_COSTS, start)
    assert offered.memory == per_call_memory
    assert offered.memory.dense_bytes[start:] == (0,) * (66 - start)
    assert offered.memory.dense_bytes[:start] == memory.dense_bytes[:start]
    assert per_call_costs.fwd_ms[start + 1] - E_COSTS.fwd_ms[start + 1] == pytest.approx(0.97 / 1.4)
    assert per_call_costs.fwd_ms[:start] == E_COSTS.fwd_ms[:start]
    assert len(offered.plan.fused) > len(with_copies.plan.fused) + 4
    assert offered.prediction.fits(E_BUDGET) and offered.plan.num_slots == plan.num_slots
    assert offered.iteration_ms == pytest.approx(e_ms(offered.plan, upload, per_call_costs))
    assert offered.iteration_ms < with_copies.iteration_ms * (1 - EVEN_GAIN)

    named = E_CONFIG.model_copy(update={"dequantize": "run"})  # copies in every run, as asked
    kept = even_cut(held, E_BUDGET, named, link, held_ms)
    assert kept is not None and kept.memory is memory and kept.plan == with_copies.plan
    monkeypatch.setattr(even_stages, "DEQUANTIZE_GBPS", 20.0)  # 48 ms a call
    slow = even_cut(held, E_BUDGET, E_CONFIG, link, held_ms)
    assert slow is not None and slow.memory is memory and slow.plan == with_copies.plan


def test_the_cuda_replan_takes_the_per_call_fused_stage_with_its_memory_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`with_link` (the CUDA re-plan) on the nf4 plan, the link measured from a run's uploads:
    the chosen device plan carries the per-call cut's memory table, from which the runtime reads
    which layers dequantize in each call (`per_call_layers_of`), and keeps the compute times."""
    from roundpipe.plan.link import link_report
    from roundpipe.planning import link_plan, link_refine
    from roundpipe.planning.dequantize import per_call_layers_of
    from roundpipe.planning.simulate import simulate

    held, upload = e_held("nf4")
    plan = held.plan
    held_ms = e_ms(plan, upload)
    report = link_report(plan, E_COSTS, upload, E_LINK_GBPS, (4,))
    choice = link_plan.LinkChoice(plan, held_ms, held_ms, report)
    monkeypatch.setattr(link_plan, "choose_link_plan", lambda *args, **kwargs: choice)
    run = simulate(
        plan, E_COSTS, 1, 4, iterations=2, link_gbps=E_LINK_GBPS, param_bytes=list(upload), round_size=4
    )
    chosen = link_refine.with_link(held, E_CONFIG, run.trace, upload)
    start = chosen.plan.fused.start
    assert start < plan.fused.start - 4 and chosen.costs == E_COSTS
    per_call = per_call_layers_of(chosen.memory)
    assert set(range(start, 66)) <= per_call and not per_call & set(range(1, start))
    assert chosen.prediction == predict_peak(chosen.plan, chosen.memory, "layer_input", act_in_flight=2)
