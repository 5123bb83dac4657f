"""The ``plan`` and ``simulate`` subcommands: the schedule, without a GPU.

Why here and not in `roundpipe.cli`: these commands drive `roundpipe.plan` and
`roundpipe.planning.simulate` (partition a model's layer costs, run the real engine on the fake
backend), and keep the dispatcher tiny. This module parses the arguments and runs the work;
`roundpipe.cli.plan_report` words and draws what they print, `roundpipe.cli.arg_types` checks the
flags, and ``trace`` (`roundpipe.cli.trace_command`) is registered from here, after ``simulate``.
``roundpipe simulate`` with no arguments is the project's demo, so it must stay quick (well under
5 s) and print something a newcomer can read. This module must never import torch or touch a
device, and never print a traceback for bad input: it raises `roundpipe.errors` / `ValueError` /
`OSError` and lets `roundpipe.cli.main` report one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.cli import trace_command
from roundpipe.cli.arg_types import (
    layer_indices,
    non_negative_float,
    non_negative_int,
    parse_bytes,
    positive_float,
    positive_int,
)
from roundpipe.plan.examples import EXAMPLES

if TYPE_CHECKING:
    from roundpipe.plan.costs import LayerCosts
    from roundpipe.plan.partition import Plan

DEFAULT_EXAMPLE = "qwen3-1.7b"
DEFAULT_DEVICES = 8
DEFAULT_MICROBATCHES = 16
DEFAULT_ITERATIONS = 4


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--costs", metavar="FILE", help="layer costs JSON (format in docs/cli.md; examples/costs.json is one)"
    )
    src.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        help=f"a built-in model instead of a costs file (default: {DEFAULT_EXAMPLE})",
    )
    p.add_argument(
        "--devices",
        "-n",
        type=positive_int,
        default=DEFAULT_DEVICES,
        metavar="N",
        help=f"number of GPUs (default {DEFAULT_DEVICES})",
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        default=DEFAULT_MICROBATCHES,
        metavar="M",
        help=f"microbatches per iteration (default {DEFAULT_MICROBATCHES})",
    )
    p.add_argument(
        "--mem-limit",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="device memory per stage, e.g. 24GB or 22GiB (default: no limit)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--async",
        dest="async_optimizer",
        action="store_true",
        default=True,
        help="asynchronous optimizer, staleness 1 (default)",
    )
    mode.add_argument("--sync", dest="async_optimizer", action="store_false", help="synchronous optimizer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


# --------------------------------------------------------------------- registration


def add_parser(subparsers: Any) -> None:
    """Register ``plan``, ``simulate`` and ``trace`` (each sets its own ``run``)."""
    p = subparsers.add_parser(
        "plan",
        help="split a model's layers into pipeline stages",
        description="Partition layer costs into forward, fused and backward stages and print the plan.",
    )
    _add_model_args(p)
    _add_loss_lag(
        p,
        "async: the training loop to plan for: 0 waits for each loss (RunConfig's default), 1 "
        "reads it one iteration late, as roundpipe train does (RunConfig.loss_lag)",
    )
    p.set_defaults(run=run_plan)
    _add_simulate_parser(subparsers)
    trace_command.add_parser(subparsers)


def _add_loss_lag(parser: argparse.ArgumentParser, text: str) -> None:
    """``--loss-lag 0|1`` (`RunConfig.loss_lag`), with what it means for the command."""
    parser.add_argument("--loss-lag", type=int, choices=(0, 1), default=0, help=text)


def _add_simulate_parser(subparsers: Any) -> None:
    s = subparsers.add_parser(
        "simulate",
        help="simulate the schedule on virtual GPUs (default: qwen3-1.7b on 8 devices)",
        description="Partition, then run the real scheduling engine on the fake backend under a "
        "virtual clock and report bubble ratio, makespan and per-device utilisation.",
    )
    _add_model_args(s)
    s.add_argument(
        "--iterations",
        "-k",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        metavar="K",
        help=f"iterations, each followed by an optimizer step (default {DEFAULT_ITERATIONS})",
    )
    s.add_argument(
        "--link-gbps",
        type=positive_float,
        default=None,
        metavar="X",
        help="host<->device link in GB/s; transfers then take time (default: free)",
    )
    s.add_argument(
        "--optimizer-ms",
        type=non_negative_float,
        default=0.0,
        metavar="X",
        help="host optimizer step per layer in ms (default 0: free)",
    )
    _add_fresh_args(s)
    s.add_argument(
        "--after-loss",
        action="store_true",
        help="submit each iteration once the previous one's losses are in, as a training loop of "
        "RoundPipe.forward_backward does (default: all at once, the chained run)",
    )
    _add_loss_lag(
        s,
        "with --after-loss: 1 reads each loss one iteration late, as roundpipe train does "
        "(RunConfig.loss_lag; the plan is chosen for it)",
    )
    _add_file_args(s)
    s.set_defaults(run=run_simulate)


def _add_fresh_args(s: argparse.ArgumentParser) -> None:
    """The async remedies a simulation can weigh: layers that read the newest weights."""
    s.add_argument(
        "--fresh-layers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="async: the deepest N layers read the newest weights (RunConfig.fresh_layers); the "
        "makespan shows what waiting for their steps costs",
    )
    s.add_argument(
        "--fresh-at",
        type=layer_indices,
        default=(),
        metavar="I[,J...]",
        help="async: the layers at these indices read the newest weights (RunConfig.fresh_at; 0 is "
        "the first layer); on a split plan the first stages then wait for the last",
    )


def _add_file_args(s: argparse.ArgumentParser) -> None:
    """``--trace``, ``--perfetto``, ``--png``: what a simulation writes besides its report."""
    # Each file flag takes a path, or none: then a file under runs/simulate/ named after the run,
    # so that an example typed in a clone leaves nothing in the working tree.
    for flag, suffix, text in SIMULATE_FILES:
        s.add_argument(
            flag,
            nargs="?",
            const=DEFAULT_FILE,
            metavar=f"OUT{suffix[suffix.rfind('.') :]}",
            help=f"{text} (alone: {SIMULATE_DIR}/<example>-<N>d-<M>mb{suffix})",
        )


def run(args: argparse.Namespace) -> int:
    """Dispatch to the subcommand's handler (`roundpipe.cli` normally does this itself)."""
    handler = args.run
    return int(handler(args))


# --------------------------------------------------------------------- plan and simulate


def _load_costs(args: argparse.Namespace) -> tuple[str, LayerCosts]:
    from roundpipe.plan.costs import LayerCosts

    if args.costs is not None:
        return str(args.costs), LayerCosts.from_json(args.costs)
    name = args.example or DEFAULT_EXAMPLE
    return name, EXAMPLES[name].costs()


def _partition(costs: LayerCosts, args: argparse.Namespace) -> Plan:
    from roundpipe.planning.ranking import choose_evaluated_plan

    return choose_evaluated_plan(
        costs,
        args.devices,
        args.microbatches,
        args.mem_limit,
        async_optimizer=args.async_optimizer,
        loss_lag=getattr(args, "loss_lag", 0),
    )


def _evaluated(plan: Plan, costs: LayerCosts, args: argparse.Namespace) -> dict[str, Any]:
    """What chose ``plan`` (`choose_evaluated_plan`): its iteration as the engine runs it on the
    fake backend (free transfers and optimizer), for the loop ``args`` plans for."""
    from roundpipe.planning.ranking import engine_evaluator, late_loop_evaluator, submission_lag

    n, m, asynch = args.devices, args.microbatches, args.async_optimizer
    lag = args.loss_lag if asynch else 0
    evaluate = (
        late_loop_evaluator(costs, n, m) if lag else engine_evaluator(costs, n, m, async_optimizer=asynch)
    )
    # A loop one loss late is let run ahead only where that is faster on this plan (`submission_lag`)
    submits = submission_lag(plan, costs, n, m, async_optimizer=asynch, loss_lag=lag)
    measure = "one iteration, fill and drain"
    if asynch:
        measure = "settled, a loop waiting for each loss"
    if lag:
        measure = "settled, a loop one loss late" + ("" if submits else ", which waits here (faster)")
    return {
        "loss_lag": lag,
        "submission_lag": submits,
        "iteration_ms": evaluate(plan),
        "iteration_measure": measure,
    }


def run_plan(args: argparse.Namespace) -> int:
    import roundpipe.planning.ranking  # noqa: F401  (imported before the clock starts)
    from roundpipe.cli.plan_report import plan_summary, print_plan

    source, costs = _load_costs(args)
    started = time.perf_counter()
    plan = _partition(costs, args)
    planning_ms = (time.perf_counter() - started) * 1e3
    info = plan_summary(plan, costs, args.devices, args.microbatches, args.async_optimizer)
    info.update(source=source, async_optimizer=args.async_optimizer, mem_limit_bytes=args.mem_limit)
    info.update(_evaluated(plan, costs, args), planning_ms=planning_ms)
    if args.json:
        print(json.dumps(info))
    else:
        print_plan(info, source, args.devices, args.microbatches, args.mem_limit)
    _advise(args, costs)
    return 0


def _advise(args: argparse.Namespace, costs: LayerCosts) -> None:
    """A microbatch count that wastes devices, said once with the better value, when the engine
    on the fake backend shows it (on stderr: --json stays one line)."""
    from roundpipe.planning.simulate import simulate
    from roundpipe.settings_advice import microbatch_advice

    def ms_per_microbatch(m: int) -> float:
        settings = argparse.Namespace(**{**vars(args), "microbatches": m})
        plan = _partition(costs, settings)
        result = simulate(plan, costs, args.devices, m, iterations=2, async_optimizer=args.async_optimizer)
        return float(result.makespan_ms) / m

    advice = microbatch_advice(args.microbatches, args.devices, ms_per_microbatch=ms_per_microbatch)
    if advice:
        print(f"note: {advice}", file=sys.stderr)


SIMULATE_DIR = "runs/simulate"
DEFAULT_FILE = "\0default"  # the value of a file flag given without a path
SIMULATE_FILES = (
    ("--trace", ".trace.json", "save the trace (roundpipe trace ... reads it)"),
    ("--perfetto", ".perfetto.json", "write a Perfetto/Chrome trace (ui.perfetto.dev)"),
    ("--png", ".png", "draw the timeline (needs matplotlib)"),
)


def _output(args: argparse.Namespace, value: str, suffix: str) -> Path:
    """Where a simulate file goes: the path given, or one under `SIMULATE_DIR` named after the
    model and the settings (its directory made)."""
    if value != DEFAULT_FILE:
        return Path(value)
    model = Path(args.costs).stem if args.costs is not None else args.example or DEFAULT_EXAMPLE
    path = Path(SIMULATE_DIR) / f"{model}-{args.devices}d-{args.microbatches}mb{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def run_simulate(args: argparse.Namespace) -> int:
    from roundpipe.cli.plan_report import plan_summary, print_simulation
    from roundpipe.planning.simulate import simulate

    source, costs = _load_costs(args)
    if (args.fresh_layers or args.fresh_at) and not args.async_optimizer:
        raise ValueError("--fresh-layers and --fresh-at are asynchronous remedies; drop them or drop --sync")
    if args.fresh_layers > costs.num_layers:
        raise ValueError(f"--fresh-layers {args.fresh_layers} but the model has {costs.num_layers} layers")
    if args.fresh_at and args.fresh_at[-1] >= costs.num_layers:
        raise ValueError(
            f"--fresh-at {','.join(map(str, args.fresh_at))} but the model has {costs.num_layers} "
            f"layers, 0 to {costs.num_layers - 1}"
        )
    if args.loss_lag and not args.after_loss:
        raise ValueError("--loss-lag says how late a training loop reads its losses; add --after-loss")
    plan = _partition(costs, args)
    info = plan_summary(plan, costs, args.devices, args.microbatches, args.async_optimizer)
    result = simulate(
        plan,
        costs,
        args.devices,
        args.microbatches,
        iterations=args.iterations,
        async_optimizer=args.async_optimizer,
        link_gbps=args.link_gbps,
        optimizer_ms=args.optimizer_ms,
        fresh_layers=args.fresh_layers,
        fresh_at=args.fresh_at,
        after_loss=args.after_loss,
        loss_lag=args.loss_lag,
    )
    files: dict[str, str] = {}
    if args.trace:
        files["trace"] = str(result.trace.save(_output(args, args.trace, ".trace.json")))
    if args.perfetto:
        files["perfetto"] = str(result.trace.to_perfetto(_output(args, args.perfetto, ".perfetto.json")))
    if args.png:
        files["png"] = str(result.trace.plot(_output(args, args.png, ".png")))
    settings = {
        "iterations": args.iterations,
        "async_optimizer": args.async_optimizer,
        "link_gbps": args.link_gbps,
        "optimizer_ms": args.optimizer_ms,
        "fresh_layers": args.fresh_layers,
        "fresh_at": list(args.fresh_at),
        "after_loss": args.after_loss,
        "loss_lag": args.loss_lag,
    }
    if args.json:
        out = {"source": source, **settings, "mem_limit_bytes": args.mem_limit, **info, **result.to_dict()}
        print(json.dumps({**out, "files": files}))
    else:
        run_settings = {**settings, "devices": args.devices, "microbatches": args.microbatches}
        print_simulation(info, result, source, run_settings, files)
    _advise(args, costs)
    return 0
