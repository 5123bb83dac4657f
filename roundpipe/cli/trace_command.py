"""The ``trace`` subcommand: check, summarise, replay, explain gaps, draw, convert or merge a saved trace.

Why apart from `roundpipe.cli.plan_commands`: ``plan`` and ``simulate`` make a schedule, this
reads one that was saved (by ``roundpipe simulate --trace``, ``pipe.trace().save()`` or a run of
``roundpipe train``). ``plan_commands`` registers it after ``simulate`` so ``roundpipe --help``
lists the commands in one order. It must never import torch or touch a device, and never print a
traceback for a bad file: it raises ``ValueError`` with one line saying what is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roundpipe.cli.arg_types import positive_int

if TYPE_CHECKING:
    from roundpipe.sched.trace import Trace


def add_parser(subparsers: Any) -> None:
    t = subparsers.add_parser(
        "trace",
        help="check, summarise, replay or convert a saved trace",
        description="Work with a trace saved by `roundpipe simulate --trace` or `pipe.trace().save()`.",
    )
    actions = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    helps = {
        "check": "verify dependencies, lanes and the five ordering rules (exit 1 if broken)",
        "summary": "print tasks, makespan, bubble ratio and, for a GPU run, what paces the compute lanes",
        "replay": "re-run on the fake backend and compare the per-lane order (exit 1 if it differs)",
        "grid": "print an ASCII timeline of the compute lanes",
        "gaps": "list the compute lanes' idle gaps, longest first, and why the next compute waited",
        "perfetto": "convert to Perfetto/Chrome trace-event JSON",
        "png": "draw the timeline as a PNG (needs matplotlib)",
    }
    for action, text in helps.items():
        a = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        a.add_argument("trace_path", metavar="TRACE.json")
        if action in ("perfetto", "png"):
            a.add_argument("-o", "--output", metavar="OUT", help="output file (default: next to TRACE)")
        if action == "gaps":
            a.add_argument("--top", type=positive_int, default=20, help="gaps listed (default 20)")
        if action == "grid":
            a.add_argument("--width", type=positive_int, default=100, help="columns (default 100)")
            a.add_argument("--all-lanes", action="store_true", help="show transfer and host lanes too")
    merge = actions.add_parser(
        "merge",
        help="merge the Perfetto traces of several ranks (torchrun) into one view",
        description="Merge Perfetto/Chrome traces of several processes into one file, a process per rank "
        "and device ('rank 1: device 0'). Give a run directory of `roundpipe train` under torchrun (its "
        "trace.json and trace.rank<R>.json) or the files, rank 0 first.",
    )
    merge.add_argument("trace_paths", nargs="+", metavar="RUN_DIR|TRACE.json")
    merge.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output file (default: trace.merged.json beside the first input)",
    )
    merge.set_defaults(run=run_merge)
    t.set_defaults(run=run_trace)


def run_merge(args: argparse.Namespace) -> int:
    """``roundpipe trace merge``: one Perfetto file of every rank's trace."""
    from roundpipe.sched.merge import MERGED_FILE, merge_perfetto, rank_files

    paths = [Path(p) for p in args.trace_paths]
    inputs = rank_files(paths)
    first = paths[0]
    out = Path(args.output) if args.output else (first if first.is_dir() else first.parent) / MERGED_FILE
    merge_perfetto(inputs, out)
    print(
        f"wrote {out}: ranks {', '.join(str(rank) for rank, _ in inputs)} (open it in https://ui.perfetto.dev)"
    )
    return 0


def load_trace(path: str) -> Trace:
    """`Trace.load` with every way a file can be wrong turned into one `ValueError` line."""
    from roundpipe.sched.trace import Trace

    try:
        return Trace.load(path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path} is not a valid roundpipe trace (bad or missing field {exc})") from exc
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _default_output(trace_path: str, suffix: str) -> Path:
    p = Path(trace_path)
    stem = p.name[: -len(".json")] if p.name.endswith(".json") else p.stem
    return p.with_name(stem + suffix)


def run_trace(args: argparse.Namespace) -> int:
    from roundpipe.sched.export import explain_violation, format_grid
    from roundpipe.sched.rules import RuleViolation

    trace = load_trace(args.trace_path)
    action = args.trace_command
    if action == "check":
        try:
            trace.check_rules()
        except RuleViolation as violation:
            print(explain_violation(trace, violation))
            print(f"roundpipe: {args.trace_path}: {violation}", file=sys.stderr)
            return 1
        print(f"ok: {len(trace)} tasks respect their dependencies, the lanes and the five ordering rules")
        return 0
    if action == "summary":
        from roundpipe.sched.breakdown import pacing

        print(trace.summary())
        paced = pacing(trace)  # traces of a backend that issues ahead (CUDA)
        if paced is not None:
            print(paced)
        print(_idle_line(trace))
        return 0
    if action == "replay":
        return _replay(trace)
    if action == "gaps":
        from roundpipe.sched.gaps import gaps_report

        print(gaps_report(trace, top=args.top))
        return 0
    if action == "grid":
        lanes = None if args.all_lanes else ("compute",)
        print(format_grid(trace, width=args.width, lanes=lanes))
        return 0
    if action == "perfetto":
        out = Path(args.output) if args.output else _default_output(args.trace_path, ".perfetto.json")
        print(f"wrote {trace.to_perfetto(out)} (open it in https://ui.perfetto.dev)")
        return 0
    if action == "png":
        out = Path(args.output) if args.output else _default_output(args.trace_path, ".png")
        print(f"wrote {trace.plot(out)}")
        return 0
    raise ValueError(f"unknown trace action {action!r}")  # pragma: no cover - argparse prevents it


def _idle_line(trace: Trace) -> str:
    """One line: the last two iterations' compute-lane gaps by cause (`trace gaps` lists them)."""
    from roundpipe.sched.gaps import find_gaps, gap_causes, last_iterations

    iterations = last_iterations(trace)
    causes = gap_causes(find_gaps(trace, iterations))
    if not causes:
        return "idle gaps of 0.5 ms or more in the last two iterations: none"
    parts = ", ".join(f"{cause} {ms / len(iterations):.1f} ms" for cause, ms in causes.items())
    return f"idle gaps per iteration (the last two) by cause: {parts} (`roundpipe trace gaps` lists them)"


def _replay(trace: Trace) -> int:
    """Replay on the fake backend; 0 when every lane runs in the recorded order, else 1 and where."""
    replayed = trace.replay()
    before, after = trace.order(), replayed.order()
    if before == after:
        print(
            f"replay: per-lane order identical ({len(before)} lanes, {len(trace)} tasks); "
            f"makespan {trace.makespan_ms():.2f} ms -> {replayed.makespan_ms():.2f} ms"
        )
        return 0
    for lane in sorted(set(before) | set(after)):
        a, b = before.get(lane, []), after.get(lane, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            got = b[i] if i < len(b) else "nothing"
            want = a[i] if i < len(a) else "nothing"
            print(f"replay: order differs on {lane} at position {i}: recorded {want}, replayed {got}")
            break
    return 1
