"""The ``roundpipe checkpoint`` commands: ``verify DIR`` checks a checkpoint against its manifest.

Why a command: before resuming a long run, or after copying a checkpoint between machines, a
person wants to know that every file is the one that was written, without building the model.
It must never import torch (it runs where torch is absent, like the schedule commands): the check
is `roundpipe.checkpoint.manifest.verify_checkpoint`, and a problem is raised as a
`CheckpointError` that `roundpipe.cli.main` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from roundpipe.checkpoint.find import resolve_checkpoint, with_alternative
from roundpipe.checkpoint.manifest import ManifestMissingError, verify_checkpoint
from roundpipe.errors import CheckpointError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "checkpoint", help="check a checkpoint directory (verify)", description="Work with checkpoints."
    )
    commands = parser.add_subparsers(dest="checkpoint_command", metavar="COMMAND", required=True)
    verify = commands.add_parser(
        "verify",
        help="check every file of a checkpoint against its manifest (size and sha256)",
        description="Print 'ok' (exit 0) when every file matches the manifest; otherwise one line "
        "naming the file and what is wrong (exit 2). A checkpoint without a manifest fails.",
    )
    verify.add_argument(
        "directory",
        metavar="DIR",
        help="the checkpoint directory, or a run directory (runs/NAME: its newest intact checkpoint)",
    )
    verify.set_defaults(run=run_verify)
    parser.set_defaults(run=run_verify)  # unreachable (a subcommand is required); cli.main wants one
    return parser


def run_verify(args: argparse.Namespace) -> int:
    checkpoint, note = resolve_checkpoint(args.directory)
    if note:
        print(note, file=sys.stderr)
    try:
        verify_checkpoint(checkpoint)
    except ManifestMissingError:
        raise
    except CheckpointError as exc:
        raise with_alternative(exc, checkpoint) from None
    print(f"ok: {checkpoint}" if note else "ok")
    return 0


__all__ = ["add_parser", "run_verify"]
