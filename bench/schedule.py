"""Benchmark: how much of the devices' time the schedule wastes, on LLM-shaped models.

The design promises that round-robin dispatch leaves the pipeline almost without bubbles. This
measures it with the real engine and the real task graphs on the fake backend (virtual clock):
profiles shaped like real LLMs (a cheap embedding, uniform decoder layers of 1 ms forward and 2 ms
backward, an LM head 3-4x a layer), 8 devices, 16 microbatches, no memory limit, free transfers.

Prints one JSON line per profile and mode:
  mode "sync": the bubble of synchronous iterations next to the balanced formula
      analytic = N(N-1)/(M*S + N(N-1)) and the bound once unequal stages are counted,
      bound = 1 - (1 - analytic) * (1 - imbalance), imbalance = 1 - mean slot / t_max.
  mode "async" (planner "t_max": partition's default objective; "steady": partition(steady=True);
      "chosen": choose_plan, what RoundPipe and the CLI run: the better of the two by the model):
      steady_bubble     simulate(iterations=6).steady_bubble_ratio: iterations 1..5, which
                        still include the run's settling
      settled_bubble    the same run continued to 14 iterations, iterations 6..13 only
      iteration_ms      the settled time per iteration; model_ms what the planner predicted
      speedup           one device running the same microbatches (forward + backward, no
                        recompute, no transfers: the plain PyTorch loop) over iteration_ms; N is ideal

    python bench/schedule.py            # 28, 32 and 64 decoder layers, head 3.5x
    python bench/schedule.py --all      # also heads 3x and 4x, and 24/48/93 layers
"""

from __future__ import annotations

import argparse
import json
import time

from roundpipe.plan import LayerCosts, Plan, analytic_bubble, choose_plan, partition
from roundpipe.plan.dispatch import steady_iteration_ms
from roundpipe.simulate import simulate

N, M = 8, 16
ASYNC_TARGET = 0.045
STEADY_ITERATIONS = 6
SETTLED_ITERATIONS, SETTLED_FROM = 14, 6


def llm(decoders: int, head: float) -> LayerCosts:
    fwd = [0.05] + [1.0] * decoders + [head]
    bwd = [0.1] + [2.0] * decoders + [2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def settled(plan: Plan, costs: LayerCosts) -> tuple[float, float]:
    """(bubble, ms per iteration) over iterations SETTLED_FROM.. of a longer async run."""
    result = simulate(plan, costs, N, M, iterations=SETTLED_ITERATIONS, async_optimizer=True)
    starts = [
        min(t.start_t for t in result.trace if t.kind == "compute" and t.iteration == i)
        for i in range(SETTLED_ITERATIONS)
    ]
    bubble = result.trace.bubble_ratio(start_ms=starts[SETTLED_FROM], end_ms=starts[-1]).overall
    return bubble, (starts[-1] - starts[SETTLED_FROM]) / (SETTLED_ITERATIONS - 1 - SETTLED_FROM)


def shape(plan: Plan) -> dict[str, object]:
    mean = sum(plan.slot_ms) / plan.num_slots
    return {
        "slots": plan.num_slots,
        "fwd_stages": len(plan.fwd_stages),
        "bwd_stages": len(plan.bwd_stages),
        "fused_layers": len(plan.fused),
        "t_max_ms": round(plan.t_max, 3),
        "imbalance": round(1 - mean / plan.t_max, 4),
        "slot_ms": [round(x, 2) for x in plan.slot_ms],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="more layer counts and head sizes")
    args = parser.parse_args()
    profiles = [(d, 3.5) for d in (28, 32, 64)]
    if args.all:
        profiles = [(d, h) for h in (3.0, 3.5, 4.0) for d in (24, 28, 32, 48, 64, 93)]
    for decoders, head in profiles:
        costs = llm(decoders, head)
        one_device_ms = M * (sum(costs.fwd_ms) + sum(costs.bwd_ms))
        base = {"bench": "schedule", "decoders": decoders, "head": head, "devices": N, "microbatches": M}

        plan = partition(costs, N, M)
        sync = simulate(plan, costs, N, M, iterations=1, async_optimizer=False)
        analytic = analytic_bubble(N, M, plan.num_slots)
        mean = sum(plan.slot_ms) / plan.num_slots
        bound = 1 - (1 - analytic) * (mean / plan.t_max)
        row: dict[str, object] = {
            **base,
            "mode": "sync",
            "bubble": round(sync.bubble_ratio, 4),
            "analytic": round(analytic, 4),
            "bound": round(bound, 4),
            "ok": sync.bubble_ratio <= bound + 1e-9,
            "iteration_ms": round(sync.makespan_ms, 1),
            "speedup": round(one_device_ms / sync.makespan_ms, 2),
            **shape(plan),
        }
        print(json.dumps(row), flush=True)

        for planner in ("t_max", "steady", "chosen"):
            start = time.perf_counter()
            if planner == "chosen":
                plan = choose_plan(costs, N, M, async_optimizer=True)
            else:
                plan = partition(costs, N, M, async_optimizer=True, steady=planner == "steady")
            plan_ms = (time.perf_counter() - start) * 1e3
            steady = simulate(plan, costs, N, M, iterations=STEADY_ITERATIONS, async_optimizer=True)
            assert steady.steady_bubble_ratio is not None
            bubble, iteration_ms = settled(plan, costs)
            row = {
                **base,
                "mode": "async",
                "planner": planner,
                "steady_bubble": round(steady.steady_bubble_ratio, 4),
                "settled_bubble": round(bubble, 4),
                "target": ASYNC_TARGET,
                "ok": steady.steady_bubble_ratio < ASYNC_TARGET,
                "iteration_ms": round(iteration_ms, 1),
                "model_ms": round(steady_iteration_ms(plan, M, N), 1),
                "speedup": round(one_device_ms / iteration_ms, 2),
                "plan_ms": round(plan_ms, 2),
                **shape(plan),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
