"""``roundpipe export CHECKPOINT DIR``: the model of any finished checkpoint, in the layout
``roundpipe train --export`` writes.

Why a command: ``--export`` runs only at the end of a run that was not interrupted, so a run
stopped by Ctrl-C, SIGTERM or a NaN, or one whose export directory was forgotten, had no way to
its model except Python. A checkpoint written by ``roundpipe train`` holds the options it was
trained with, so the model can be rebuilt exactly (same preset or config, same LoRA rank and
seed), the checkpoint loaded into it (verified against its manifest first), and the model saved
with its own ``save_pretrained`` (and the run's tokenizer beside it) through `roundpipe.checkpoint.export_pretrained`, the function
``--export`` uses, so the two give the same files.

It must never import torch when the parser is built (``roundpipe --help`` stays fast), never
train, and never write anywhere but the export directory, which is checked before any model is
built (`roundpipe.outputs.check_export_target`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from roundpipe.errors import CheckpointError
from roundpipe.outputs import check_export_target

# The export needs the weights only: one CPU worker rebuilds them, whatever the run used.
EXPORT_DEVICES = "cpu:1"


def export_checkpoint(checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str]) -> Path:
    """Export the model of a ``roundpipe train`` checkpoint into ``directory`` (the
    ``save_pretrained`` layout: the full model, or the adapters of a LoRA run); returns it."""
    from roundpipe.checkpoint import export_pretrained, load_checkpoint, read_checkpoint_meta
    from roundpipe.checkpoint.find import resolve_checkpoint
    from roundpipe.pipe import RoundPipe
    from roundpipe.quiet import quiet_libraries
    from roundpipe.train.config import make_config
    from roundpipe.train.model import build_model, build_tokenizer

    checkpoint, _ = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(checkpoint)
    saved = meta.get("extra", {}).get("train_config")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"checkpoint {checkpoint} was not written by 'roundpipe train' (it holds no training options), "
            "so its model cannot be rebuilt here; in Python, load it into the same RoundPipe with "
            "load_checkpoint and call roundpipe.checkpoint.export_pretrained"
        )
    target = check_export_target(Path(directory).expanduser())
    options = {**saved, "resume": None, "export": None, "overwrite": False, "devices": EXPORT_DEVICES}
    config = make_config(options, source=f"{checkpoint}/meta.json")
    tokenizer = build_tokenizer(config)
    with quiet_libraries():
        model = build_model(config, tokenizer)
    run = config.run_config().model_copy(update={"replan": False})
    with RoundPipe(model, config=run) as pipe:
        load_checkpoint(pipe, checkpoint, restore_rng=False)
        return export_pretrained(pipe, target, tokenizer)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "export",
        help="export the model of a roundpipe train checkpoint (save_pretrained layout)",
        description=(
            "Rebuild the model a 'roundpipe train' checkpoint was trained on, load the checkpoint "
            "(verified against its manifest) and save the model with save_pretrained into DIR: the "
            "full model, or only the LoRA adapters of a --lora-r run. The same files as "
            "'roundpipe train --export DIR'. DIR must be new, empty, or an earlier export."
        ),
    )
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint directory (runs/NAME/checkpoint), or a run directory (its newest intact checkpoint)",
    )
    parser.add_argument("directory", metavar="DIR", help="where to write the model")
    return parser


def run(args: argparse.Namespace) -> int:
    path = export_checkpoint(args.checkpoint, args.directory)
    print(f"exported {args.checkpoint} to {path}")
    return 0


__all__ = ["EXPORT_DEVICES", "add_parser", "export_checkpoint", "run"]
