"""Benchmark: how fast the scheduling engine runs real task graphs, and how fast they are built.

The engine must stay cheap next to the work it schedules (DESIGN: well under 1% of a step, and
10^5 fake tasks in about a second on two cores), and its cost per task must not grow with the
graph. This measures exactly that, on the graphs the training path builds: `GraphBuilder` turns
an LLM-shaped plan (an embedding, decoder layers, an LM head 3.5x a layer; N=8 devices, M=16
microbatches, async optimizer, 16 GB/s links, so every transfer has a duration) into iterations
of tasks, and the real `Engine` runs them on the fake backend (virtual clock, no sleeping).

Prints one JSON line per graph size (~10^3, 10^4, 10^5 tasks):
  build_us_per_task   building the graphs (GraphBuilder), per task (and with the cyclic GC paused)
  seconds, tasks_per_s, us_per_task   the engine run only (submit + wait), best of the repeats
  engine_share_of_step   engine wall time per iteration / simulated iteration time: the
                        engine's overhead relative to the GPU work it schedules
and a last line comparing the per-task cost of the largest and the smallest graph.

    python bench/engine.py            # all sizes
    python bench/engine.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

from roundpipe.backends.fake import FakeBackend, FakeCostModel
from roundpipe.plan import LayerCosts, partition
from roundpipe.sched.engine import Engine
from roundpipe.sched.event_loop import run_sync
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import Task

N, M = 8, 16
DECODERS = 28
LINK_GBPS = 16.0
TARGET_TASKS_PER_S = 100_000
TARGET_FLATNESS = 1.3  # us/task at 10^5 over us/task at 10^3
MIB = 2**20


def llm_costs() -> LayerCosts:
    fwd = [0.05] + [1.0] * DECODERS + [3.5]
    bwd = [0.1] + [2.0] * DECODERS + [7.0]
    mem = [64 * MIB] + [128 * MIB] * DECODERS + [448 * MIB]
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(mem))


def build(costs: LayerCosts, iterations: int, *, collect: bool = True) -> tuple[list[list[Task]], float]:
    """Every iteration's and step's tasks, as the training path submits them; and the build time.

    ``collect=False`` builds with the cyclic garbage collector paused, to show how much of the
    build time is the collector walking the growing graph rather than the builder itself."""
    plan = partition(costs, N, M, async_optimizer=True)
    spec = ModelSpec(
        param_bytes=costs.mem_bytes, owners=tuple((i,) for i in range(costs.num_layers)), act_bytes=8 * MIB
    )
    builder = GraphBuilder(plan, spec, N, ScheduleOptions(async_optimizer=True))
    gc.collect()
    if not collect:
        gc.disable()
    try:
        start = time.perf_counter()
        batches: list[list[Task]] = []
        for it in range(iterations):
            batches.append(builder.forward_backward(it, it, M).tasks)
            batches.append(builder.optimizer_step(it))
        return batches, time.perf_counter() - start
    finally:
        gc.enable()


def run(costs: LayerCosts, batches: list[list[Task]]) -> tuple[float, float]:
    """Engine wall time (submit + wait, inside the loop) and the simulated makespan in ms."""
    engine = Engine(
        FakeBackend(FakeCostModel(costs, link_gbps=LINK_GBPS, optimizer_ms=0.05), shared_link=True)
    )
    elapsed = 0.0

    async def main() -> None:
        nonlocal elapsed
        start = time.perf_counter()
        for batch in batches:
            engine.submit(batch)
        await engine.wait()
        elapsed = time.perf_counter() - start

    gc.collect()
    run_sync(main())
    return elapsed, engine.trace.makespan_ms()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    costs = llm_costs()
    per_iteration = sum(len(b) for b in build(costs, 1)[0])
    run(costs, build(costs, 1)[0])  # warm up: imports, the event loop, first-use caches
    per_task: list[float] = []
    for target in (1_000, 10_000, 100_000):
        iterations = max(1, round(target / per_iteration))
        repeats = (2 if target >= 100_000 else 3) if args.quick else (3 if target >= 100_000 else 7)
        runs, builds = [], []
        tasks = 0
        makespan = 0.0
        for _ in range(repeats):
            batches, build_s = build(costs, iterations)  # a graph runs once: build a fresh one each time
            tasks = sum(len(b) for b in batches)
            seconds, makespan = run(costs, batches)
            runs.append(seconds)
            builds.append(build_s)
        best = min(runs)
        _, build_nogc = build(costs, iterations, collect=False)
        row: dict[str, object] = {
            "bench": "engine",
            "tasks": tasks,
            "iterations": iterations,
            "seconds": round(best, 5),
            "median_seconds": round(statistics.median(runs), 5),
            "tasks_per_s": round(tasks / best),
            "us_per_task": round(best / tasks * 1e6, 3),
            "build_us_per_task": round(min(builds) / tasks * 1e6, 3),
            "build_us_per_task_gc_paused": round(build_nogc / tasks * 1e6, 3),
            "engine_share_of_step": round(best * 1e3 / makespan, 5),
            "simulated_ms": round(makespan, 1),
            "ok": tasks / best >= TARGET_TASKS_PER_S,
            "repeats": repeats,
            "python": platform.python_version(),
        }
        per_task.append(best / tasks * 1e6)
        print(json.dumps(row), flush=True)
    flatness = per_task[-1] / per_task[0]
    print(
        json.dumps(
            {
                "bench": "engine_flatness",
                "us_per_task_ratio": round(flatness, 3),
                "target": TARGET_FLATNESS,
                "ok": flatness <= TARGET_FLATNESS,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
