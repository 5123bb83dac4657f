"""The plan of a link-bound run, judged with its uploads: the fake engine with the link on.

Why: the planner judges plans with free transfers (`roundpipe.planning.ranking`), right while uploads
hide behind compute. When they do not (`roundpipe.plan.link`: a mixture of experts moving 1.2 GB
a layer), a plan with a longer fused stage uploads less, and one with more slots spreads the
uploads over more devices; which is faster depends on the link. `choose_link_plan` takes the plan
chosen on compute times and the one chosen on link-aware times (`link_costs`), runs both on the
fake engine with the link's bandwidth and each layer's uploaded bytes, and keeps the faster: never
slower, under that model, than the compute-only choice, which it keeps on equal times.

It lives outside ``plan`` because it runs the engine; ``plan`` stays pure. It must never touch a
device or sleep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.link import LinkReport, link_costs, link_report
from roundpipe.plan.partition import Plan
from roundpipe.plan.rounds import round_sizes
from roundpipe.planning.simulate import simulate

ASYNC_ITERATIONS = 4
"""An async plan's time with the link is the mean over this many chained iterations, the step
after each included (the first one fills the pipeline and pays its uploads unhidden)."""

MakePlan = Callable[[LayerCosts], Plan]


@dataclass(frozen=True)
class LinkChoice:
    """The plan to run, its time per iteration with the link on, and the link's share of it."""

    plan: Plan
    iteration_ms: float
    compute_only_ms: float  # the compute-only choice's time with the link on
    report: LinkReport


def link_iteration_ms(
    plan: Plan,
    costs: LayerCosts,
    param_bytes: Sequence[int],
    link_gbps: float,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    prefetch_stages: int = 1,
) -> float:
    """Milliseconds per iteration of ``plan`` on the fake engine with the link on (every
    layer's ``param_bytes`` uploaded per slot and round at ``link_gbps``, ``prefetch_stages``
    stages ahead)."""
    iterations = ASYNC_ITERATIONS if async_optimizer else 1
    result = simulate(
        plan,
        costs,
        plan.num_devices,
        num_microbatches,
        iterations=iterations,
        async_optimizer=async_optimizer,
        link_gbps=link_gbps,
        param_bytes=list(param_bytes),
        round_size=round_size,
        prefetch_stages=prefetch_stages,
    )
    return result.makespan_ms / iterations


def choose_link_plan(
    make_plan: MakePlan,
    costs: LayerCosts,
    param_bytes: Sequence[int],
    link_gbps: float,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
) -> LinkChoice:
    """The faster, with the link on, of ``make_plan(costs)`` and ``make_plan`` on link-aware
    costs (``make_plan``: the caller's planner, with its memory rule)."""
    rounds = round_sizes(num_microbatches, num_devices, round_size)

    def timed(plan: Plan) -> float:
        return link_iteration_ms(
            plan,
            costs,
            param_bytes,
            link_gbps,
            num_microbatches,
            async_optimizer=async_optimizer,
            round_size=round_size,
        )

    base = make_plan(costs)
    base_ms = timed(base)
    plan, plan_ms = base, base_ms
    aware = make_plan(link_costs(costs, param_bytes, link_gbps, min(rounds)))
    if aware != base:
        aware_ms = timed(aware)
        if aware_ms < base_ms:
            plan, plan_ms = aware, aware_ms
    report = link_report(plan, costs, param_bytes, link_gbps, rounds)
    return LinkChoice(plan, plan_ms, base_ms, report)
