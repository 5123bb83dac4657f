"""The ``roundpipe`` command line's dispatcher over the command modules beside it.

Why so small: each subcommand lives in a module of its own in this package (``plan``/``simulate``/
``trace`` in `roundpipe.cli.plan_commands`, ``train`` in `roundpipe.cli.train_command`, which hands
the run to `roundpipe.train`), so this file only builds the top-level parser, lets each command module register itself, and turns expected failures into
one ``roundpipe: error: ...`` line and exit code 2. Importing it, or any command module, must never
import torch or do real work: ``roundpipe --help``, ``plan``, ``simulate`` and ``trace`` start fast
and run where torch is not installed (tests/test_layering.py runs them with torch blocked); only
``roundpipe train`` loads torch, when it runs.

A command module plugs in by defining ``add_parser(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``, and by being listed in `COMMAND_MODULES`. A module that registers several
subcommands sets ``run`` on each of its parsers with ``parser.set_defaults(run=...)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from roundpipe.errors import RoundPipeError

# Modules whose subcommands make up `roundpipe`, in the order `roundpipe --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "roundpipe.cli.plan_commands",
    "roundpipe.cli.train_command",
    "roundpipe.cli.checkpoint_commands",
    "roundpipe.cli.export_command",
)

# A failed check (exit 1) is a command's own result; the dispatcher only knows these two.
EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130


class UsageError(Exception):
    """Bad command-line arguments (argparse's complaints, re-routed so `main` can return 2)."""


class RoundPipeArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reports errors as ``roundpipe: error: ...`` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = RoundPipeArgumentParser(
        prog="roundpipe",
        description="Fine-tune large models on a few small GPUs; plan and simulate round-robin pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=RoundPipeArgumentParser
    )
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        sub = module.add_parser(subparsers)
        if isinstance(sub, argparse.ArgumentParser) and sub.get_default("run") is None:
            sub.set_defaults(run=module.run)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("roundpipe")
    except Exception:  # not installed (running from a source tree)
        return "unknown"


def _error(message: str) -> int:
    print(f"roundpipe: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``roundpipe`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        # Ctrl-C before a command installs its own handling (while the parser's modules or torch
        # load, while a model is built): nothing was written, so one line and no traceback.
        print("roundpipe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _error(str(exc))
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(run(args))
    except UsageError as exc:
        return _error(str(exc))
    except (RoundPipeError, ValueError, ImportError) as exc:
        return _error(str(exc) or type(exc).__name__)
    except OSError as exc:
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        return _error(f"{where}{exc.strerror or exc}")
