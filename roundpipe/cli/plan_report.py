"""What ``roundpipe plan`` and ``roundpipe simulate`` print: the plan's numbers and the tables.

Why apart from `roundpipe.cli.plan_commands`: that module parses arguments and runs the planner and
the simulation; this one only turns their results into a JSON-ready summary and rich tables, so
each stays short and the wording of the demo can change without touching the commands. It must
never plan, simulate or read files, never import torch, and import rich only when it prints.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from roundpipe.plan.dispatch import analytic_bubble
from roundpipe.plan.examples import EXAMPLES
from roundpipe.plan.partition import objective

if TYPE_CHECKING:
    from rich.console import Console

    from roundpipe.plan.costs import LayerCosts
    from roundpipe.plan.partition import Plan
    from roundpipe.planning.simulate import SimulationResult


def console() -> Console:
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False)


def layers_text(layers: range) -> str:
    """``3`` for one layer, ``3-7`` for layers 3 to 7."""
    first, last = layers.start, layers.stop - 1
    return f"{first}" if first == last else f"{first}-{last}"


def bytes_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def plan_summary(
    plan: Plan, costs: LayerCosts, num_devices: int, num_microbatches: int, async_optimizer: bool
) -> dict[str, Any]:
    """The numbers both ``plan`` and ``simulate`` report about a plan, JSON-ready."""
    stage_ms = list(plan.stage_ms(costs))
    slots = [
        {
            "index": slot.index,
            "name": slot.name,
            "kind": slot.kind,
            "layers": [slot.layers.start, slot.layers.stop],
            "ms": ms,
            "mem_bytes": costs.stage_mem(slot.layers),
        }
        for slot, ms in zip(plan.slots, stage_ms, strict=True)
    ]
    n, m, s = num_devices, num_microbatches, plan.num_slots
    return {
        "num_layers": costs.num_layers,
        "num_devices": n,
        "num_microbatches": m,
        "slots": slots,
        "num_slots": s,
        "t_max_ms": plan.t_max,
        "objective_ms": objective(plan, n, m, async_optimizer=async_optimizer),
        "objective_formula": "M * max(S, N) * t_max" if async_optimizer else "(M*S + N*(N-1)) * t_max",
        "analytic_bubble": analytic_bubble(n, m, s),
        # Mean stage time over t_max: 100% when every slot takes exactly t_max.
        "balance": math.fsum(stage_ms) / (s * plan.t_max) if plan.t_max > 0 else 1.0,
    }


def print_plan(
    info: dict[str, Any], source: str, devices: int, microbatches: int, mem_limit: int | None
) -> None:
    """The ``roundpipe plan`` table: one row per slot, then t_max, the evaluated iteration that chose
    the plan, the objective and the bubble."""
    from rich.table import Table

    out = console()
    # A line of its own, not the table's title: rich wraps a title to the table's width, which cut
    # "16 / microbatches" apart at 80 columns.
    out.print(
        f"plan for {source}: {info['num_layers']} layers on {devices} devices, {microbatches} microbatches",
        soft_wrap=True,
        style="italic",
    )
    table = Table()
    table.add_column("slot")
    table.add_column("kind")
    table.add_column("layers", justify="right")
    table.add_column("ms / microbatch", justify="right")
    table.add_column("memory", justify="right")
    for slot in info["slots"]:
        table.add_row(
            slot["name"],
            slot["kind"],
            layers_text(range(*slot["layers"])),
            f"{slot['ms']:.2f}",
            bytes_text(slot["mem_bytes"]),
        )
    out.print(table)
    out.print(f"t_max            {info['t_max_ms']:.2f} ms (slowest stage)")
    out.print(f"slots            {info['num_slots']}")
    if "iteration_ms" in info:  # what chose the plan (the objective only generates candidates)
        out.print(f"iteration        {info['iteration_ms']:.1f} ms ({info['iteration_measure']})")
        out.print("                 what chose the plan: the engine on the fake backend")
    out.print(f"objective        {info['objective_ms']:.1f} ms = {info['objective_formula']}")
    out.print(f"analytic bubble  {info['analytic_bubble']:.2%}")
    if mem_limit is not None:
        out.print(f"memory limit     {bytes_text(mem_limit)} per stage")
    if "planning_ms" in info:
        out.print(f"planned in       {info['planning_ms']:.0f} ms")


def print_simulation(
    info: dict[str, Any], result: SimulationResult, source: str, run: dict[str, Any], files: dict[str, str]
) -> None:
    """The ``roundpipe simulate`` report: what ran, the plan, the bubble, per-device utilisation.

    ``run`` holds the command's settings: devices, microbatches, iterations, async_optimizer,
    link_gbps.
    """
    out = console()
    _print_setting(out, info, source, run)
    _print_metrics(out, info, result, run["iterations"])
    _print_utilisation(out, result)
    for kind, path in files.items():
        out.print(f"wrote {kind}: {path}")


def _print_setting(out: Console, info: dict[str, Any], source: str, run: dict[str, Any]) -> None:
    from rich.padding import Padding
    from rich.text import Text

    mode = "async optimizer (staleness 1)" if run["async_optimizer"] else "sync optimizer"
    iterations, link = run["iterations"], run["link_gbps"]
    out.print(
        f"[bold]roundpipe simulate[/bold]: {source}, {info['num_layers']} layers on {run['devices']} devices"
    )
    if source in EXAMPLES:
        out.print(f"  [dim]{EXAMPLES[source].description}[/dim]")
    out.print(
        f"  {run['microbatches']} microbatches x {iterations} "
        f"iteration{'s' if iterations > 1 else ''}, {mode}, "
        + (f"link {link:g} GB/s" if link else "transfers free")
    )
    out.print()
    out.print(
        f"[bold]plan[/bold]  {info['num_slots']} slots, t_max {info['t_max_ms']:.2f} ms, "
        f"stages balanced to {info['balance']:.0%} of t_max"
    )
    stages = "  ".join(f"{s['name']}:{layers_text(range(*s['layers']))}" for s in info["slots"])
    out.print(Padding(Text(stages), (0, 0, 0, 2)))
    out.print()


def _print_metrics(out: Console, info: dict[str, Any], result: SimulationResult, iterations: int) -> None:
    from rich.table import Table

    metrics = Table(show_header=False, box=None, padding=(0, 1))
    metrics.add_column(style="bold")
    metrics.add_column(justify="right")
    metrics.add_column(style="dim")
    metrics.add_row("bubble ratio", f"{result.bubble_ratio:.2%}", "idle compute, fill and drain included")
    if result.steady_bubble_ratio is not None:
        metrics.add_row(
            "steady-state bubble",
            f"{result.steady_bubble_ratio:.2%}",
            f"iterations 1-{iterations - 2}, no fill or drain",
        )
    metrics.add_row("analytic bubble", f"{info['analytic_bubble']:.2%}", "N(N-1) / (M*S + N(N-1))")
    metrics.add_row(
        "makespan", f"{result.makespan_ms:.1f} ms", f"{result.makespan_ms / iterations:.1f} ms per iteration"
    )
    metrics.add_row("tasks", f"{len(result.trace)}", "")
    out.print(metrics)
    out.print()


def _print_utilisation(out: Console, result: SimulationResult) -> None:
    from rich.table import Table

    util = Table(title="per-device utilisation", title_justify="left")
    util.add_column("device")
    util.add_column("busy ms", justify="right")
    util.add_column("utilisation", justify="right")
    util.add_column("", no_wrap=True)
    for device, u in sorted(result.utilisation.items()):
        filled = round(u * 30)
        util.add_row(
            f"d{device}",
            f"{result.bubble.busy_ms.get(device, 0.0):.1f}",
            f"{u:.1%}",
            "[green]" + "█" * filled + "[/green][dim]" + "░" * (30 - filled) + "[/dim]",
        )
    out.print(util)
