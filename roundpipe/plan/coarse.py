"""The coarsest plan a memory limit allows on one device: each stage as many layers as fit.

Why: on one device every plan computes the same layers, so the engine's evaluation (compute only,
transfers free) gives every candidate the same iteration time, and `partition`'s objective, the
slowest slot, then cuts the finest stages the memory limit allows. What that evaluation cannot see
is what each stage costs beyond its layers on a real device: the host issues every compute task
(on an H100 host 2-3.5 ms a task above its layers, for Qwen3-30B-A3B's; a plan of 71 slots over 16
microbatches is 1,888 compute tasks an iteration, one of 25 slots 592), and every stage boundary
moves each microbatch's activation down to the host and up again over the same link as the
weights (D at 16 x 4,096 tokens: 1.3 s of activation uploads an iteration against 3.0 s of
weights). Fewer, larger stages cut both: on an H100 that run trains at 11,500 tok/s in 17
slots against 7,009 in 70 (docs/performance.md). The cost: larger stages hold more weights on the device,
so less room is left for uploading further ahead (`roundpipe.planning.link_refine.with_prefetch`).

The plan: a fused stage of the longest tail of layers that fits, then forward stages cut greedily
from the first layer and backward stages from the fused stage down, each as long as fits. "Fits"
is `partition`'s memory rule: a stage may use at most half the limit, so it fits beside the stage
prefetched behind it (`Plan.from_stages` checks it and names a layer too large on its own).

Greedy cuts leave the remainder in the last stage of each direction: a one-layer forward stage
before a six-layer fused stage computes for far less time than the fused stage's weights take to
upload behind it. `evenly_cut` spreads the same layers over the same number of stages, the larger
ones first in computing order, and may start the fused stage earlier: every stage shares one cap,
half the limit, because the stage uploaded behind it may be as large, which it is not where the
uploads are smaller than what a stage holds (a 4-bit base, dense once a run: a quarter of its
bytes), and each layer more in the fused stage is one layer less recomputed.
`roundpipe.planning.even_stages` takes such a cut where the fake engine with the measured link
runs it faster and its predicted peak fits.

It must stay pure: numbers in, a `Plan` out.
"""

from __future__ import annotations

from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import Plan


def _longest(costs: LayerCosts, cap: int, first: int, last: int, step: int) -> int:
    """From layer ``first`` walking by ``step`` (1 or -1) towards ``last`` (exclusive): the far
    end of the longest run of layers whose memory fits ``cap`` (at least one layer)."""
    used = costs.mem_bytes[first]
    end = first + step
    while end != last and used + costs.mem_bytes[end] <= cap:
        used += costs.mem_bytes[end]
        end += step
    return end


def coarsest_plan(
    costs: LayerCosts, num_microbatches: int, mem_limit_bytes: int, backward_layers: int | None = None
) -> Plan:
    """One device's plan of the fewest stages under ``mem_limit_bytes`` (module docstring), its
    backward stages at most ``backward_layers`` long when given (one: every layer's recompute
    starts from its own saved input, so each skips its frozen tail, `roundpipe.model.frozen_tail`)."""
    cap = mem_limit_bytes // 2
    n = costs.num_layers
    fused_start = _longest(costs, cap, n - 1, -1, -1) + 1
    fwd: list[range] = []
    start = 0
    while start < fused_start:
        stop = _longest(costs, cap, start, fused_start, 1)
        fwd.append(range(start, stop))
        start = stop
    bwd: list[range] = []
    stop = fused_start
    while stop > 0:
        start = _longest(costs, cap, stop - 1, -1, -1) + 1
        if backward_layers is not None:
            start = max(start, stop - backward_layers)
        bwd.append(range(start, stop))
        stop = start
    return Plan.from_stages(
        fwd, range(fused_start, n), bwd, costs, 1, num_microbatches, mem_limit_bytes=mem_limit_bytes
    )


def _even_sizes(layers: int, stages: int) -> list[int]:
    """``layers`` over ``stages``, sizes at most one apart, the larger ones first."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def evenly_cut(plan: Plan, costs: LayerCosts, fused_start: int | None = None) -> Plan:
    """``plan`` (one device's) with its fused stage from layer ``fused_start`` (default: where
    ``plan``'s starts) and as many forward and backward stages as ``plan`` (fewer where fewer
    layers are left before the fused stage), the layers before the fused stage spread over each as
    evenly as whole layers allow, larger stages first in the order they compute (forward from the
    first layer, backward from the fused stage down). Memory is left to the caller's prediction:
    at ``fused_start`` at or past ``plan``'s, a stage here is never longer than the longest one of
    ``plan`` in its direction."""
    first_fused = plan.fused.start if fused_start is None else fused_start
    fwd: list[range] = []
    start = 0
    for size in _even_sizes(first_fused, min(first_fused, len(plan.fwd_stages))):
        fwd.append(range(start, start + size))
        start += size
    bwd: list[range] = []
    stop = first_fused
    for size in _even_sizes(first_fused, min(first_fused, len(plan.bwd_stages))):
        bwd.append(range(stop - size, stop))
        stop -= size
    fused = plan.fused if fused_start is None else range(fused_start, plan.fused.stop)
    return Plan.from_stages(fwd, fused, bwd, costs, plan.num_devices, plan.num_microbatches)
