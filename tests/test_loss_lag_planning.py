"""Plans for a loop that reads each loss one iteration late (`RunConfig.loss_lag=1`).

What must hold: such a loop is timed exactly (the replay equals the engine: test_plan_replay),
it never runs a plan slower than the loop that waits for every loss would (where submitting
early is slower, the step waits for its losses: `submission_lag`), and it is faster where the
waiting loop leaves devices idle between iterations.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.plan import _families, _refine
from roundpipe.planning.ranking import choose_evaluated_plan, engine_evaluator, submission_lag
from tests.helpers import batches, mlp
from tests.test_plan_choice import grid_costs

mse = nn.functional.mse_loss


@pytest.mark.parametrize(
    ("layers", "ratio", "head", "n", "m"),
    [(24, 2.0, 1.0, 8, 16), (24, 1.3, 1.0, 8, 16), (24, 1.3, 2.0, 4, 8)],
)
def test_a_loop_one_iteration_late_never_runs_slower_than_the_waiting_loop(
    layers: int, ratio: float, head: float, n: int, m: int
) -> None:
    costs = grid_costs(layers, ratio, head)
    waiting_plan = choose_evaluated_plan(costs, n, m, None, async_optimizer=True)
    waiting_ms = engine_evaluator(costs, n, m, async_optimizer=True)(waiting_plan)
    plan = choose_evaluated_plan(costs, n, m, None, async_optimizer=True, loss_lag=1)
    lag = submission_lag(plan, costs, n, m, async_optimizer=True, loss_lag=1)
    late_ms = engine_evaluator(costs, n, m, async_optimizer=True, loss_lag=lag)(plan)
    assert late_ms <= waiting_ms * (1 + 1e-9)
    # The waiting loop idles devices between iterations: settled, 2.6%, 5.1% and 25.6% shorter.
    assert lag == 1 and late_ms < (0.98 if n == 8 else 0.8) * waiting_ms


def test_the_step_waits_where_early_submission_is_slower() -> None:
    """On some plans iteration t + 1's forward runs take devices iteration t's backward needs:
    there `submission_lag` says 0 and ``step()`` waits for the losses (24 layers, backward 2x,
    head 1x: a 9-slot plan settles at 245.0 ms waiting, 256.0 ms submitting early)."""
    from roundpipe.plan.choose import even_plan

    costs = grid_costs(24, 2.0, 1.0)
    plan = even_plan([range(0, 7), range(7, 14), range(14, 21)], range(21, 26), [
        range(17, 21), range(13, 17), range(9, 13), range(5, 9), range(0, 5)], costs, 8, 16)  # fmt: skip
    waiting = engine_evaluator(costs, 8, 16, async_optimizer=True)(plan)
    early = engine_evaluator(costs, 8, 16, async_optimizer=True, loss_lag=1)(plan)
    assert (waiting, early) == pytest.approx((245.01, 256.0), abs=0.01)
    assert submission_lag(plan, costs, 8, 16, async_optimizer=True, loss_lag=1) == 0


def test_sync_plans_and_a_waiting_loop_keep_their_lag() -> None:
    costs = grid_costs(24, 2.0, 1.0)
    plan = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=False, loss_lag=1)
    assert submission_lag(plan, costs, 8, 16, async_optimizer=False, loss_lag=1) == 1
    assert submission_lag(plan, costs, 8, 16, async_optimizer=True, loss_lag=0) == 0


def compute_starts(pipe: roundpipe.RoundPipe) -> list[tuple[object, float]]:
    return sorted((task.key, task.start_t) for task in pipe.trace() if task.kind == "compute")


def test_a_step_that_waits_for_its_losses_submits_as_the_waiting_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where `submission_lag` says 0, ``step()`` waits for its iteration's losses, and a loop
    reading each loss late runs on the engine exactly as the waiting loop."""
    import roundpipe.planning.replan
    from roundpipe.planning.replan import RunPlanner

    data = batches(5)
    runs = []
    # One plan for both loops (the late one may be planned otherwise): the submissions are compared.
    chosen = roundpipe.planning.replan.choose_evaluated_plan
    monkeypatch.setattr(
        roundpipe.planning.replan,
        "choose_evaluated_plan",
        lambda *args, **kwargs: chosen(*args, **{**kwargs, "loss_lag": 0}),
    )
    for lag, gate in ((0, False), (1, True)):
        monkeypatch.setattr(RunPlanner, "waits_for_loss", lambda self, plan, costs, gate=gate: gate)
        config = roundpipe.RunConfig(devices="fake:3", num_microbatches=6, loss_lag=lag)
        with roundpipe.RoundPipe(
            mlp(depth=6), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config=config
        ) as pipe:
            waiting = []
            for x, y in data:
                waiting.append(pipe.forward_backward(x, y, mse, wait=False))
                pipe.step()
                if gate:
                    assert waiting[-1].done()  # the step read it
                while len(waiting) > lag:
                    waiting.pop(0).result()
            pipe.synchronize()
            runs.append(compute_starts(pipe))
    assert runs[0] == runs[1]


def test_a_late_loop_also_times_the_runner_up_few_slot_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid shape (28 layers, backward 2.5x, head 1x, 8 devices x 16 microbatches) where the
    late loop's best plan (the fastest of every even plan, `bench/schedule.py --exhaustive
    --loss-lag 1`: 250.14 ms, settled) is the chained ranking's second few-slot plan: with only
    the first timed, a 19-slot plan settling at 265.67 ms was chosen (and still is, where the
    late loop's own model does not look: `LATE_MODELLED` and `LATE_EQUAL_TIMED` 0; with it, a
    6-slot plan at 251.77)."""
    from roundpipe.plan.choose import even_plan
    from roundpipe.planning.ranking import late_loop_evaluator

    costs = grid_costs(28, 2.5, 1.0)
    best = even_plan([range(0, 23)], range(23, 30), [range(17, 23), range(11, 17), range(6, 11), range(0, 6)], costs, 8, 16)  # fmt: skip
    evaluate = late_loop_evaluator(costs, 8, 16)
    chosen = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert evaluate(chosen) <= evaluate(best) == pytest.approx(250.14, abs=0.01)
    monkeypatch.setattr(_families, "LATE_FEW_TIMED", 1)
    monkeypatch.setattr(_families, "LATE_MODELLED", 0)
    monkeypatch.setattr(_families, "LATE_EQUAL_TIMED", 0)
    first_only = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert evaluate(first_only) == pytest.approx(265.67, abs=0.01)


def test_a_late_loop_times_the_few_slot_plans_its_own_model_ranks_best(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grid shape (28 layers, backward 2.5x, head 2x, 8 x 16) whose fastest plans for a loop one
    loss late have 5-7 slots: they settle, submitted late, after a few slow iterations, which the
    chained ranking's window of 4 reads (355-381 ms modelled for plans that run at 260). Ranked by
    the late loop's own model (each iteration gated on the losses of the one two back, over 10
    iterations: `_ranking.LATE_MODEL_ITERATIONS`), the best of them are timed: 7 slots, 259.61 ms,
    the fastest even plan (over 8 iterations: a 5-slot plan at 259.90); without it a 19-slot plan
    at 266.05."""
    from roundpipe.planning.ranking import late_loop_evaluator

    costs = grid_costs(28, 2.5, 2.0)
    evaluate = late_loop_evaluator(costs, 8, 16)
    chosen = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert (chosen.num_slots, evaluate(chosen)) == (7, pytest.approx(259.61, abs=0.01))
    monkeypatch.setattr(_families, "LATE_MODELLED", 0)
    monkeypatch.setattr(_families, "LATE_EQUAL_TIMED", 0)
    chained_only = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert (chained_only.num_slots, evaluate(chained_only)) == (19, pytest.approx(266.05, abs=0.01))


def test_a_late_loop_times_the_best_plan_of_equal_stages_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 layers, backward 1.3x, head 3x, 8 x 16: the fastest even plan for a loop one loss late
    (7 slots: forward stages of 10 and 10 layers, the fused stage from layer 20, backward stages
    of 5: 172.77 ms) lies outside the families the late loop ranks (its fused stage 3 layers
    longer than the mean slot's); of the plans of equal stages (`_candidates.equal_splits`) it is
    the late loop's model's best, and timed (`LATE_EQUAL_TIMED`). Without, a 5-slot plan at
    177.18 ms, 2.6% slower."""
    from roundpipe.planning.ranking import late_loop_evaluator

    costs = grid_costs(24, 1.3, 3.0)
    evaluate = late_loop_evaluator(costs, 8, 16)
    chosen = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert [len(r) for r in chosen.fwd_stages] == [10, 10] and chosen.fused.start == 20
    assert [len(r) for r in chosen.bwd_stages] == [5, 5, 5, 5]
    assert evaluate(chosen) == pytest.approx(172.77, abs=0.01)
    monkeypatch.setattr(_families, "LATE_EQUAL_TIMED", 0)
    without = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert (without.num_slots, evaluate(without)) == (5, pytest.approx(177.18, abs=0.01))


def test_a_late_loop_refines_around_few_slot_plans_by_its_own_model_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 layers, backward 3.8x, head 1x, 8 x 16: the fastest even plan for a loop one loss late
    (7 slots, fused stage from layer 27: 371.70 ms) is a neighbour of the best the first timings
    find (fused from 28: 374.58), and the best of its neighbours by the late loop's own model;
    `_refine` times the best by that model too (`REFINE_LATE_TIMED`)."""
    from roundpipe.planning.ranking import late_loop_evaluator

    costs = grid_costs(32, 3.8, 1.0)
    evaluate = late_loop_evaluator(costs, 8, 16)
    chosen = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert (chosen.num_slots, chosen.fused.start, evaluate(chosen)) == (
        7,
        27,
        pytest.approx(371.70, abs=0.01),
    )
    monkeypatch.setattr(_refine, "REFINE_LATE_TIMED", 0)
    before = choose_evaluated_plan(costs, 8, 16, None, async_optimizer=True, loss_lag=1)
    assert (before.num_slots, before.fused.start, evaluate(before)) == (
        7,
        28,
        pytest.approx(374.58, abs=0.01),
    )
