"""Benchmark: how long `roundpipe.plan.partition` takes on realistic layer costs.

Prints one JSON line per result. Costs: a cheap embedding, L-2 decoder layers (1 ms forward,
2 ms backward, 1 GiB, each with seeded +-3% noise) and an LM head 3.5x a layer; N=8 devices,
M=16 microbatches, and a memory limit of 13 GiB (6.5 GiB per stage: forward stages, which would
otherwise hold ~10 layers, are cut by memory). For L <= 95 it also runs a plain exhaustive search
(every candidate t_max, each checked by an O(L) greedy: the published O(L^3) method) on the same
costs, checks that both find the same objective, and reports the ratio.

It then times what a run really plans with, `roundpipe.planning.ranking.choose_evaluated_plan`
(candidates around the proxies, ranked by a model and timed on the fake engine; above
`EVALUATE_MAX_LAYERS` the proxies decide), on the grid costs of `bench/schedule.py --grid`
(94 decoder layers, backward 2x forward, head 3x a layer, no memory limit; and 1000 layers), in
both modes (and async for a loop one loss late): targets 50 ms at 94 layers and 1 s at 1000.
``compiled`` says whether the planner's compiled loops ran (`roundpipe.plan.native`;
``ROUNDPIPE_PURE_PYTHON=1`` times the Python loops).

    python bench/partition.py            # all sizes
    python bench/partition.py --quick    # fewer repeats
    python bench/partition.py --choose   # only the choose_evaluated_plan timings
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from roundpipe.plan import LayerCosts, Plan, analytic_bubble, native, objective, partition
from roundpipe.planning import ranking
from roundpipe.planning.ranking import choose_evaluated_plan

GIB = 2**30
N, M = 8, 16
MEM_LIMIT = 13 * GIB
TARGET_MS = {28: 2.0, 95: 2.0, 1000: 1000.0}
CHOOSE_TARGET_MS = {94: 50.0, 1000: 1000.0}  # decoder layers -> choose_evaluated_plan target


def grid_costs(decoders: int, bwd_ratio: float = 2.0, head: float = 3.0) -> LayerCosts:
    """As `bench/schedule.py --grid`: an embedding of 1% of a layer, decoders, the head (bwd 2x)."""
    fwd = [0.01, *[1.0] * decoders, head]
    bwd = [0.01 * bwd_ratio, *[bwd_ratio] * decoders, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def time_choose(repeats: int) -> None:
    """Median ms of `choose_evaluated_plan` at (N, M) = (8, 16), per size and mode: sync, async,
    and async for a loop that reads each loss one iteration late (``lag1``: what `roundpipe
    train` plans with)."""
    for decoders, target in CHOOSE_TARGET_MS.items():
        costs = grid_costs(decoders)
        for mode in ("sync", "async", "lag1"):
            times = []
            for _ in range(repeats if decoders < 1000 else max(1, repeats // 3)):
                ranking._submissions_of.cache_clear()  # a late loop's timings are remembered
                start = time.perf_counter()
                plan = choose_evaluated_plan(
                    costs, N, M, None, async_optimizer=mode != "sync", loss_lag=int(mode == "lag1")
                )
                times.append((time.perf_counter() - start) * 1e3)
            ms = statistics.median(times)
            row = {
                "bench": "choose_evaluated_plan",
                "decoders": decoders,
                "mode": mode,
                "compiled": native.kernels() is not None,
                "ms": round(ms, 1),
                "min_ms": round(min(times), 1),
                "target_ms": target,
                "ok": ms < target,
                "slots": plan.num_slots,
                "repeats": len(times),
            }
            print(json.dumps(row), flush=True)


def realistic_costs(num_layers: int, seed: int = 0) -> LayerCosts:
    rng = random.Random(seed)
    decoders = num_layers - 2
    fwd = [0.05] + [1.0 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(decoders)] + [3.5]
    bwd = [0.1] + [2.0 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(decoders)] + [7.0]
    mem = [GIB // 2] + [int(GIB * (1 + rng.uniform(-0.02, 0.02))) for _ in range(decoders)] + [int(3.5 * GIB)]
    names = ["embed_tokens"] + [f"layers.{i}" for i in range(decoders)] + ["lm_head"]
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(mem), tuple(names))


def naive_objective(costs: LayerCosts, n: int, m: int, limit: int) -> float:
    """Every consecutive-layer sum as a candidate t_max, each checked by a linear greedy."""
    f = costs.fwd_ms
    c = [a + b for a, b in zip(costs.fwd_ms, costs.bwd_ms, strict=True)]
    mem = costs.mem_bytes
    cap = limit // 2
    count = len(f)
    lowest = max(c)
    candidates: set[float] = set()
    for values in (f, c):
        for i in range(count):
            acc = 0.0
            for j in range(i, count):
                acc += values[j]
                if acc >= lowest:
                    candidates.add(acc)

    def greedy(values: list[float] | tuple[float, ...], stop: int, t: float) -> int:
        stages, acc, used = 0, 0.0, 0
        for i in range(stop):
            if stages and acc + values[i] <= t and used + mem[i] <= cap:
                acc += values[i]
                used += mem[i]
            else:
                stages, acc, used = stages + 1, values[i], mem[i]
        return stages

    best = float("inf")
    for t in candidates:
        p, acc, used = count, 0.0, 0
        while p > 0 and acc + c[p - 1] <= t and used + mem[p - 1] <= cap:
            p -= 1
            acc += c[p]
            used += mem[p]
        slots = 1 + greedy(f, p, t) + greedy(c, p, t)
        best = min(best, (m * slots + n * (n - 1)) * t)
    return best


def time_partition(costs: LayerCosts, repeats: int, async_optimizer: bool) -> tuple[float, Plan]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = partition(costs, N, M, MEM_LIMIT, async_optimizer=async_optimizer)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--choose", action="store_true", help="only time choose_evaluated_plan")
    args = parser.parse_args()
    if not args.choose:
        time_partitions(args.quick)
    time_choose(3 if args.quick else 9)


def time_partitions(quick: bool) -> None:
    for layers in (28, 95, 1000):
        costs = realistic_costs(layers)
        repeats = (20 if layers < 1000 else 3) if quick else (200 if layers < 1000 else 11)
        for async_optimizer in (False, True):
            ms, plan = time_partition(costs, repeats, async_optimizer)
            row: dict[str, object] = {
                "bench": "partition",
                "layers": layers,
                "mode": "async" if async_optimizer else "sync",
                "ms": round(ms, 4),
                "target_ms": TARGET_MS[layers],
                "ok": ms < TARGET_MS[layers],
                "slots": plan.num_slots,
                "fwd_stages": len(plan.fwd_stages),
                "bwd_stages": len(plan.bwd_stages),
                "fused_layers": len(plan.fused),
                "t_max_ms": round(plan.t_max, 4),
                "repeats": repeats,
            }
            if not async_optimizer:
                row["analytic_bubble"] = round(analytic_bubble(N, M, plan.num_slots), 4)
            if layers <= 95 and not async_optimizer:
                start = time.perf_counter()
                naive = naive_objective(costs, N, M, MEM_LIMIT)
                naive_ms = (time.perf_counter() - start) * 1e3
                ours = objective(plan, N, M)
                assert abs(naive - ours) <= 1e-9 * naive, (naive, ours)
                row["naive_ms"] = round(naive_ms, 1)
                row["speedup_vs_naive"] = round(naive_ms / ms, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
