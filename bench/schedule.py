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

  --grid: the profile grid of the schedule-quality targets, one JSON line per shape and mode:
      layers {24,28,32,48,64,94} x backward/forward {1.3,2,2.5,3.8} x head/layer {1,2,3,4} (head
      backward 2x its forward, embedding 1% of a layer) x (N, M) {(8,16),(4,8),(2,4)}; the plan is
      choose_plan with the engine evaluator (what RoundPipe runs). Per line: slots, bubble (sync:
      one iteration; async: iterations 2-6 of a chained run of 6), analytic N(N-1)/(M*S+N(N-1)) of
      the chosen S (sync), ok (sync: bubble <= analytic + 1.5 points; async: < 3% at (8, 16)),
      iteration_ms, proxy_ms (the plan chosen without evaluation), planning_ms; async also
      loop_ms (the chosen plan as a training loop runs it once settled: each iteration submitted
      once the previous losses are in, what planning.ranking judges by) and chained_choice_loop_ms (the same for
      the plan a chained evaluation, every iteration submitted at once, would choose).
    python bench/schedule.py --grid [--layers 24 28] [--modes sync] [--devices 8] [--evaluations 8]
                                    [--no-refine]   # the ranking's choice, without choose_plan's refinement

  --exhaustive: for the async grid shapes at (N, M) = (8, 16) of --layers (default 24 28 32; each
      shape times about a thousand plans, 1-30 s; --layers 48 64 94 reach 4,200, 7,500 and 16,000
      plans a shape, about 2, 4.5 and 14 minutes per 16 shapes for the late loop), the chosen plan against every even plan
      (`every_even_plan`), all timed as choose_plan's evaluator times them (a training loop's
      submission, the time per iteration it settles at): chosen_ms, best_ms, gap (chosen / best - 1), and the fastest even plan whose
      chained steady bubble is under 3% (none when there is none within 10% of the chosen).
      ``--loss-lag 1``: for a loop reading each loss one iteration late (roundpipe train's).
      ``--modes sync [async]``: sync plans too (the makespan of one iteration; "on target" is
      bubble <= analytic + 1.5 points); ``--devices 8 4``: those (N, M) of the grid.
    python bench/schedule.py --exhaustive [--layers 24] [--loss-lag 1] [--modes sync] [--devices 8 4]

  --planning: choose_plan's time on the 16 grid shapes of --layers (default 94) at (8, 16), for
      sync, the async loop waiting for each loss and the late loop (with its submission check):
      the median of 5 calls per shape, then per loop the median, the maximum and how many are
      under the 50 ms target. Run it on a quiet machine: other work moves these by 1.5x. To
      compare two versions of the code, alternate them instead: bench/planning_ab.py.
    python bench/schedule.py --planning [--layers 94]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from roundpipe.plan import LayerCosts, Plan, analytic_bubble, choose_plan, partition
from roundpipe.plan.choose import every_even_plan
from roundpipe.plan.dispatch import steady_iteration_ms
from roundpipe.planning.ranking import (
    choose_evaluated_plan,
    engine_evaluator,
    iteration_starts,
    late_loop_evaluator,
    submission_lag,
)
from roundpipe.planning.simulate import simulate

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


GRID_LAYERS = (24, 28, 32, 48, 64, 94)
EXHAUSTIVE_LAYERS = (24, 28, 32)  # --exhaustive: about a thousand plans a shape at these counts
GRID_BWD_RATIOS = (1.3, 2.0, 2.5, 3.8)
GRID_HEADS = (1.0, 2.0, 3.0, 4.0)
GRID_DEVICES = ((8, 16), (4, 8), (2, 4))
SYNC_SLACK = 0.015  # sync target: bubble <= analytic + 1.5 points
ASYNC_GRID_TARGET = 0.03  # async target at (8, 16): steady bubble < 3%


def grid_costs(layers: int, bwd_ratio: float, head: float) -> LayerCosts:
    """Embedding (1% of a layer), ``layers`` decoder layers of 1 ms forward, and the head."""
    fwd = [0.01, *[1.0] * layers, head]
    bwd = [0.01 * bwd_ratio, *[bwd_ratio] * layers, 2.0 * head]
    return LayerCosts(tuple(fwd), tuple(bwd), (0,) * len(fwd))


def measure(plan: Plan, costs: LayerCosts, n: int, m: int, async_optimizer: bool) -> tuple[float, float]:
    """(bubble, ms per iteration): one sync iteration, or iterations 2-6 of a chained async run."""
    if not async_optimizer:
        run = simulate(plan, costs, n, m, iterations=1, async_optimizer=False)
        return run.bubble_ratio, run.makespan_ms
    run = simulate(plan, costs, n, m, iterations=STEADY_ITERATIONS, async_optimizer=True)
    starts = iteration_starts(run, STEADY_ITERATIONS)
    assert run.steady_bubble_ratio is not None
    return run.steady_bubble_ratio, (starts[-1] - starts[1]) / (STEADY_ITERATIONS - 2)


def loop_ms(plan: Plan, costs: LayerCosts, n: int, m: int, loss_lag: int = 0) -> float:
    """Async ms per iteration as a training loop runs it, once settled: each iteration submitted
    once the previous one's losses are in (`simulate(..., after_loss=True)`), or with
    ``loss_lag=1`` once the losses of the one before that are (each loss read one iteration late);
    run on the engine (`engine_evaluator(..., engine=True)`, `roundpipe.planning.replay.settled_ms`)."""
    return engine_evaluator(costs, n, m, async_optimizer=True, loss_lag=loss_lag, engine=True)(plan)


def grid_row(
    layers: int,
    ratio: float,
    head: float,
    n: int,
    m: int,
    async_optimizer: bool,
    evaluations: int | None = None,
    refine: bool | None = None,
) -> dict[str, object]:
    """One shape and mode of the grid, planned as RoundPipe plans it (``evaluations``: as many
    plans timed, instead of `choose_plan`'s default; ``refine=False``: without `choose_plan`'s
    refinement, the ranking's choice alone)."""
    costs = grid_costs(layers, ratio, head)
    evaluate = engine_evaluator(costs, n, m, async_optimizer=async_optimizer)
    start = time.perf_counter()
    plan = choose_plan(
        costs,
        n,
        m,
        async_optimizer=async_optimizer,
        evaluate=evaluate,
        evaluations=evaluations,
        refine=refine,
    )
    planning_ms = (time.perf_counter() - start) * 1e3
    proxy = choose_plan(costs, n, m, async_optimizer=async_optimizer)
    bubble, iteration_ms = measure(plan, costs, n, m, async_optimizer)
    analytic = analytic_bubble(n, m, plan.num_slots)
    if async_optimizer:
        ok: bool | None = bubble < ASYNC_GRID_TARGET if (n, m) == (8, 16) else None
    else:
        ok = bubble <= analytic + SYNC_SLACK
    loop: dict[str, object] = {}
    if async_optimizer:
        # What a training loop runs, for the plan chosen and for the one a chained evaluation
        # (`engine_evaluator(..., loop=False)`) would choose.
        chained = engine_evaluator(costs, n, m, async_optimizer=True, loop=False)
        chained_choice = choose_plan(
            costs,
            n,
            m,
            async_optimizer=True,
            evaluate=chained,
            evaluations=evaluations,
            loop=False,
            refine=refine,
        )
        # And a loop that reads each loss one iteration late (`RunConfig.loss_lag=1`, roundpipe
        # train's default), with the plan chosen for it as `choose_evaluated_plan` chooses (the
        # better of the two submissions per plan), run as the pipe runs it (`submission_lag`).
        start = time.perf_counter()
        lag_choice = choose_plan(
            costs,
            n,
            m,
            async_optimizer=True,
            evaluate=late_loop_evaluator(costs, n, m),
            evaluations=evaluations,
            late=True,
            refine=refine,
        )
        lag = submission_lag(lag_choice, costs, n, m, async_optimizer=True, loss_lag=1)
        lag_planning_ms = (time.perf_counter() - start) * 1e3
        loop = {
            "loop_ms": round(loop_ms(plan, costs, n, m), 2),
            "chained_choice_loop_ms": round(loop_ms(chained_choice, costs, n, m), 2),
            "lag1_slots": lag_choice.num_slots,
            "lag1_loop_ms": round(loop_ms(lag_choice, costs, n, m, loss_lag=lag), 2),
            "lag1_step_waits": lag == 0,
            "lag1_planning_ms": round(lag_planning_ms, 1),
        }
    return {
        "bench": "schedule-grid",
        "layers": layers,
        "bwd_ratio": ratio,
        "head": head,
        "devices": n,
        "microbatches": m,
        "mode": "async" if async_optimizer else "sync",
        "slots": plan.num_slots,
        "fwd_stages": len(plan.fwd_stages),
        "bwd_stages": len(plan.bwd_stages),
        "fused_layers": len(plan.fused),
        "bubble": round(bubble, 4),
        "analytic": round(analytic, 4),
        "ok": ok,
        "iteration_ms": round(iteration_ms, 2),
        "proxy_ms": round(measure(proxy, costs, n, m, async_optimizer)[1], 2),
        "planning_ms": round(planning_ms, 1),
        **loop,
    }


def grid(args: argparse.Namespace) -> None:
    devices = [nm for nm in GRID_DEVICES if args.devices is None or nm[0] in args.devices]
    for layers, ratio, head, (n, m), mode in itertools.product(
        args.layers or GRID_LAYERS, GRID_BWD_RATIOS, GRID_HEADS, devices, args.modes
    ):
        row = grid_row(
            layers, ratio, head, n, m, mode == "async", args.evaluations, False if args.no_refine else None
        )
        print(json.dumps(row), flush=True)


def tables(path: str) -> None:
    """Markdown tables of a --grid output: per (N, M) and mode, the shapes that meet the target,
    the worst miss, how much evaluation gained over the proxies' plan, and planning time."""
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    print(
        "| mode | N, M | shapes | on target | worst (shape: bubble vs target) | gain over proxy: mean / max | planning ms: median / max |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, (n, m) in itertools.product(("sync", "async"), GRID_DEVICES):
        group = [r for r in rows if r["mode"] == mode and (r["devices"], r["microbatches"]) == (n, m)]
        if not group:
            continue
        gains = [1 - r["iteration_ms"] / r["proxy_ms"] for r in group]
        plan_ms = sorted(r["planning_ms"] for r in group)
        if mode == "sync":
            worst = max(group, key=lambda r: r["bubble"] - r["analytic"])
            target = f"{100 * (worst['analytic'] + SYNC_SLACK):.1f}%"
            met = sum(bool(r["ok"]) for r in group)
        else:
            worst = max(group, key=lambda r: r["bubble"])
            target = f"{100 * ASYNC_GRID_TARGET:.0f}%" if (n, m) == (8, 16) else "-"
            met = sum(r["bubble"] < ASYNC_GRID_TARGET for r in group)
        shape = f"{worst['layers']}L r{worst['bwd_ratio']} h{worst['head']:g}, S={worst['slots']}"
        print(
            f"| {mode} | {n}, {m} | {len(group)} | {met} | {shape}: {100 * worst['bubble']:.1f}% vs {target} "
            f"| {100 * sum(gains) / len(gains):.1f}% / {100 * max(gains):.1f}% "
            f"| {plan_ms[len(plan_ms) // 2]:.0f} / {plan_ms[-1]:.0f} |"
        )
    layer_table(rows)
    loop_table(rows)


def loop_table(rows: list[dict[str, Any]]) -> None:
    """Async, where the rows have them: the training-loop time of the plan chosen against the
    plan the chained figure alone would choose (per (N, M): mean and largest gain, shapes worse)."""
    looped = [r for r in rows if r["mode"] == "async" and "loop_ms" in r]
    if not looped:
        return
    print("\n| N, M | shapes | training-loop ms vs the chained choice: mean / best | shapes slower (worst) |")
    print("| --- | --- | --- | --- |")
    for n, m in GRID_DEVICES:
        group = [r for r in looped if (r["devices"], r["microbatches"]) == (n, m)]
        if not group:
            continue
        gains = [
            1 - r["loop_ms"] / r.get("chained_choice_loop_ms", r.get("unbounded_loop_ms")) for r in group
        ]
        worse = [g for g in gains if g < -1e-9]
        worst = f" ({100 * min(worse):+.1f}%)" if worse else ""
        print(
            f"| {n}, {m} | {len(group)} | {100 * sum(gains) / len(gains):+.1f}% / {100 * max(gains):+.1f}% "
            f"| {len(worse)}{worst} |"
        )


def layer_table(rows: list[dict[str, Any]]) -> None:
    """At (8, 16): per layer count and mode, shapes on target and the largest excess over it."""
    print(
        "\n| layers | sync on target | sync worst excess (points) | async on target (< 3%) | async worst bubble |"
    )
    print("| --- | --- | --- | --- | --- |")
    for layers in GRID_LAYERS:
        at = [r for r in rows if r["layers"] == layers and (r["devices"], r["microbatches"]) == (8, 16)]
        sync = [r for r in at if r["mode"] == "sync"]
        late = [r for r in at if r["mode"] == "async"]
        if not sync and not late:
            continue
        excess = max((float(r["bubble"]) - float(r["analytic"]) - SYNC_SLACK for r in sync), default=0.0)
        worst = max((float(r["bubble"]) for r in late), default=0.0)
        print(
            f"| {layers} | {sum(bool(r['ok']) for r in sync)}/{len(sync)} | {100 * max(excess, 0.0):.1f} "
            f"| {sum(bool(r['ok']) for r in late)}/{len(late)} | {100 * worst:.1f}% |"
        )


def exhaustive_row(
    layers: int,
    ratio: float,
    head: float,
    n: int = 8,
    m: int = 16,
    loss_lag: int = 0,
    async_optimizer: bool = True,
) -> dict[str, object]:
    """One grid shape: the chosen plan's time per iteration against every even plan's, all by
    choose_plan's own evaluator, and the fastest even plan on the bubble target (async: under 3%;
    sync: within 1.5 points of its slot count's analytic bubble). With ``loss_lag=1`` (async),
    for a loop that reads each loss one iteration late (`roundpipe train`'s): chosen as
    `choose_evaluated_plan(..., loss_lag=1)` chooses, every plan timed by the better of its two
    submissions (`late_loop_evaluator`)."""
    start = time.perf_counter()
    costs = grid_costs(layers, ratio, head)
    if loss_lag and async_optimizer:
        evaluate = late_loop_evaluator(costs, n, m)
    else:
        evaluate = engine_evaluator(costs, n, m, async_optimizer=async_optimizer)
    chosen = choose_plan(
        costs,
        n,
        m,
        async_optimizer=async_optimizer,
        evaluate=evaluate,
        late=bool(loss_lag and async_optimizer),
    )
    chosen_ms = evaluate(chosen)
    plans = every_even_plan(costs, n, m)
    timed = sorted((evaluate(p), i) for i, p in enumerate(plans))
    best_ms, best = timed[0][0], plans[timed[0][1]]

    def on_target(plan: Plan, bubble: float) -> bool:
        if async_optimizer:
            return bubble < ASYNC_GRID_TARGET
        return bubble <= analytic_bubble(n, m, plan.num_slots) + SYNC_SLACK

    under: dict[str, object] | None = None
    for ms, i in timed:  # fastest first: the first on target is the fastest one
        if ms > 1.1 * chosen_ms:
            break
        bubble, _ = measure(plans[i], costs, n, m, async_optimizer)
        if on_target(plans[i], bubble):
            under = {
                "ms": round(ms, 2),
                "vs_chosen": round(ms / chosen_ms - 1, 4),
                "bubble": round(bubble, 4),
            }
            under["slots"] = plans[i].num_slots
            break
    return {
        "bench": "schedule-exhaustive",
        "mode": "async" if async_optimizer else "sync",
        "layers": layers,
        "bwd_ratio": ratio,
        "head": head,
        "devices": n,
        "microbatches": m,
        "loss_lag": loss_lag,
        "plans": len(plans),
        "chosen_ms": round(chosen_ms, 2),
        "chosen_slots": chosen.num_slots,
        "chosen_bubble": round(measure(chosen, costs, n, m, async_optimizer)[0], 4),
        "best_ms": round(best_ms, 2),
        "best_slots": best.num_slots,
        "gap": round(chosen_ms / best_ms - 1, 4),
        "fastest_under_target": under,
        "seconds": round(time.perf_counter() - start, 1),
    }


PLANNING_REPEATS = 5


def planning_rows(layers: int, n: int = 8, m: int = 16) -> list[dict[str, object]]:
    """Planning time per grid shape of ``layers`` at (n, m), for the three loops RoundPipe plans
    for (sync; async waiting for each loss; async reading each loss one iteration late), as the
    pipe plans (`choose_evaluated_plan`, then its `submission_lag` check): the median of PLANNING_REPEATS calls, each with a fresh
    evaluator and no remembered evaluations."""
    from roundpipe.planning.ranking import _submissions_of

    rows: list[dict[str, object]] = []
    for ratio, head in itertools.product(GRID_BWD_RATIOS, GRID_HEADS):
        costs = grid_costs(layers, ratio, head)
        for loop in ("sync", "async", "late"):
            times, plan = [], None
            for _ in range(PLANNING_REPEATS):
                _submissions_of.cache_clear()
                start = time.perf_counter()
                asynchronous, loss_lag = loop != "sync", int(loop == "late")
                plan = choose_evaluated_plan(
                    costs, n, m, None, async_optimizer=asynchronous, loss_lag=loss_lag
                )
                submission_lag(plan, costs, n, m, async_optimizer=asynchronous, loss_lag=loss_lag)
                times.append((time.perf_counter() - start) * 1e3)
            assert plan is not None
            rows.append(
                {
                    "bench": "schedule-planning",
                    "layers": layers,
                    "bwd_ratio": ratio,
                    "head": head,
                    "devices": n,
                    "microbatches": m,
                    "loop": loop,
                    "slots": plan.num_slots,
                    "planning_ms": round(sorted(times)[len(times) // 2], 1),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all", action="store_true", help="more layer counts and head sizes")
    parser.add_argument(
        "--grid", action="store_true", help="the profile grid of the schedule-quality targets"
    )
    parser.add_argument(
        "--layers", type=int, nargs="+", help="layer counts (--grid: all six; --exhaustive: 24 28 32)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["sync", "async"], help="default both (--exhaustive: async)"
    )
    parser.add_argument("--devices", type=int, nargs="+", choices=[8, 4, 2], help="grid (N, M) by N")
    parser.add_argument("--evaluations", type=int, help="plans choose_plan times (default: its own)")
    parser.add_argument("--no-refine", action="store_true", help="grid: choose_plan(..., refine=False)")
    parser.add_argument("--tables", metavar="GRID_JSONL", help="print the docs tables of a --grid output")
    parser.add_argument(
        "--exhaustive", action="store_true", help="async choices at (8, 16) against every even plan"
    )
    parser.add_argument(
        "--planning", action="store_true", help="planning ms per grid shape at (8, 16) (default 94 layers)"
    )
    parser.add_argument(
        "--loss-lag",
        type=int,
        choices=(0, 1),
        default=0,
        help="--exhaustive: plan and time for a loop reading each loss this late (roundpipe train: 1)",
    )
    args = parser.parse_args()
    args.modes_given = args.modes is not None
    args.modes = args.modes or ["sync", "async"]
    if args.tables:
        tables(args.tables)
        return
    if args.planning:
        for count in args.layers or [94]:
            rows = planning_rows(count)
            for row in rows:
                print(json.dumps(row), flush=True)
            for loop in ("sync", "async", "late"):
                ms = sorted(float(r["planning_ms"]) for r in rows if r["loop"] == loop)  # type: ignore[arg-type]
                summary = {"bench": "schedule-planning-summary", "layers": count, "loop": loop}
                summary |= {
                    "median_ms": ms[len(ms) // 2],
                    "max_ms": ms[-1],
                    "under_50": sum(x < 50 for x in ms),
                }
                print(json.dumps(summary), flush=True)
        return
    if args.exhaustive:
        # async at (8, 16) unless asked otherwise (what the targets name); sync when --modes says
        modes = args.modes if args.modes_given else ["async"]
        pairs = [(n, m) for n, m in GRID_DEVICES if n in (args.devices or [8])]
        for mode, (n, m) in itertools.product(modes, pairs):
            for count in args.layers or EXHAUSTIVE_LAYERS:
                for ratio, head in itertools.product(GRID_BWD_RATIOS, GRID_HEADS):
                    row = exhaustive_row(
                        count, ratio, head, n, m, loss_lag=args.loss_lag, async_optimizer=mode == "async"
                    )
                    print(json.dumps(row), flush=True)
        return
    if args.grid:
        grid(args)
        return
    llm_profiles(args.all)


def llm_profiles(everything: bool) -> None:
    """The default run: the uniform-decoder profiles, sync and the three async planners."""
    profiles = [(d, 3.5) for d in (28, 32, 64)]
    if everything:
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
