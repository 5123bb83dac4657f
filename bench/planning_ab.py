"""Benchmark: planning time of two checkouts of roundpipe, alternated, on the 94-layer grid shapes.

Why apart from `bench/schedule.py --planning`: on a shared machine the time of one choice moves
by 1.3-1.7x within minutes, so two runs of that bench at different times compare the machine as
much as the code. This one runs both checkouts in turns, each in a process of its own (a compiled
`roundpipe.plan._kernels` is loaded once per process, so two versions of it need two processes):
per round, each checkout's process plans the 16 grid shapes of ``--layers`` ``--repeats`` times;
after ``--rounds`` rounds each shape keeps the least of its times. Prints one JSON line per loop
(sync; async waiting for each loss; async reading each loss one iteration late): per checkout the
sum over the shapes, the heaviest shape, how many are under 50 ms and the per-shape figures, and
whether both chose the same plans.

    python bench/planning_ab.py --base ../other-checkout [--loops sync async late] [--rounds 4]
                                [--repeats 2] [--layers 94] [--devices 8]

``--base`` is a checkout with its extension built (`python setup.py build_ext --inplace`); the
other is this one. Plans are compared by their stages.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _child(loop: str, repeats: int, layers: int, devices: int) -> None:
    """One process's share: every grid shape planned ``repeats`` times, as JSON on stdout."""
    import roundpipe
    from roundpipe.planning.ranking import _submissions_of, choose_evaluated_plan

    sys.path.insert(0, str(HERE / "bench"))
    from schedule import GRID_BWD_RATIOS, GRID_DEVICES, GRID_HEADS, grid_costs

    microbatches = dict(GRID_DEVICES)[devices]
    rows: dict[str, object] = {}
    for ratio, head in itertools.product(GRID_BWD_RATIOS, GRID_HEADS):
        costs = grid_costs(layers, ratio, head)
        times, plan = [], None
        for _ in range(repeats):
            _submissions_of.cache_clear()  # no remembered evaluations from the previous call
            start = time.perf_counter()
            plan = choose_evaluated_plan(
                costs,
                devices,
                microbatches,
                None,
                async_optimizer=loop != "sync",
                loss_lag=int(loop == "late"),
            )
            times.append((time.perf_counter() - start) * 1e3)
        assert plan is not None
        stages = [[r.start for r in plan.fwd_stages], plan.fused.start, [r.start for r in plan.bwd_stages]]
        rows[f"{ratio}/{head}"] = {"ms": min(times), "stages": stages}
    print(json.dumps({"roundpipe": roundpipe.__file__, "rows": rows}))


def _run(checkout: Path, args: argparse.Namespace, loop: str) -> dict[str, dict[str, object]]:
    """One process of ``checkout`` planning ``loop`` (its own roundpipe first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, __file__, "--child", loop, "--repeats", str(args.repeats)]
    command += ["--layers", str(args.layers), "--devices", str(args.devices)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode != 0:
        raise SystemExit(f"planning_ab: the process of {checkout} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(result["roundpipe"]).startswith(str(checkout)):
        raise SystemExit(
            f"planning_ab: the process meant for {checkout} imported {result['roundpipe']}; "
            "is roundpipe installed there as a package rather than used from the checkout?"
        )
    return result["rows"]  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="the other checkout (its extension built)")
    parser.add_argument(
        "--loops", nargs="+", choices=["sync", "async", "late"], default=["sync", "async", "late"]
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="choices per shape per process")
    parser.add_argument("--layers", type=int, default=94)
    parser.add_argument("--devices", type=int, default=8, choices=[8, 4, 2], help="(N, M) of the grid, by N")
    parser.add_argument("--child", choices=["sync", "async", "late"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.repeats, args.layers, args.devices)
        return
    if args.base is None:
        parser.error("--base: the checkout to compare this one with")
    checkouts = {"base": args.base.resolve(), "this": HERE}
    for loop in args.loops:
        least: dict[str, dict[str, float]] = {name: {} for name in checkouts}
        stages: dict[str, dict[str, object]] = {name: {} for name in checkouts}
        for _ in range(args.rounds):
            for name, checkout in checkouts.items():
                for shape, row in _run(checkout, args, loop).items():
                    ms = float(row["ms"])  # type: ignore[index,arg-type]
                    least[name][shape] = min(ms, least[name].get(shape, ms))
                    stages[name][shape] = row["stages"]  # type: ignore[index]
        summary: dict[str, object] = {"bench": "planning-ab", "loop": loop, "layers": args.layers}
        summary["devices"] = args.devices
        for name in checkouts:
            figures = least[name]
            summary[name] = {
                "sum_ms": round(sum(figures.values()), 1),
                "max_ms": round(max(figures.values()), 1),
                "under_50": sum(ms < 50 for ms in figures.values()),
                "per_shape": {shape: round(ms, 1) for shape, ms in figures.items()},
            }
        summary["same_plans"] = stages["base"] == stages["this"]
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
