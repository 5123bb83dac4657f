"""`RunPlanner`: a run re-plans once, from complete measured times, to the plan those times give;
incomplete times leave the plan alone and the re-plan still due."""

from __future__ import annotations

from roundpipe.config import RunConfig
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.examples import EXAMPLES
from roundpipe.planning.replan import RunPlanner, plan_for
from roundpipe.sched.trace import Trace


def _planner(**options: object) -> tuple[RunPlanner, LayerCosts]:
    config = RunConfig(devices="fake:2", num_microbatches=4, async_optimizer=False, **options)  # type: ignore[arg-type]
    spec = config.device_spec()
    return RunPlanner(config, spec.kind, spec.indices, spec.count), EXAMPLES["tiny"].costs()


def test_a_run_replans_once_from_complete_measured_times() -> None:
    planner, costs = _planner()
    assert not planner.claim_profile()  # fake devices, no budget: nothing to measure on a device
    assert planner.first_plan(costs) == plan_for(costs, planner.config, 2)
    assert not planner.replan_due(0) and planner.replan_due(1)
    params = tuple(costs.mem_bytes)
    incomplete = [1.0] * (costs.num_layers - 1) + [None]
    assert planner.replan(costs, Trace(), incomplete, params) is None
    assert planner.replan_due(1)  # still due: tried again after the next iteration
    measured = [float(i + 1) for i in range(costs.num_layers)]
    replan = planner.replan(costs, Trace(), measured, params)
    assert replan is not None and replan.device_plan is None
    assert replan.costs.fwd_ms == tuple(measured) and replan.costs.bwd_ms == tuple(2 * m for m in measured)
    assert replan.plan == plan_for(replan.costs, planner.config, 2)
    assert not planner.replan_due(5)


def test_replan_off_never_replans() -> None:
    planner, _ = _planner(replan=False)
    assert not planner.replan_due(10)
