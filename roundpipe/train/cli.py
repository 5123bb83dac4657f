"""The ``roundpipe train`` subcommand: parse options, merge them, call `roundpipe.train.train`.

Why thin: the options live in `TrainConfig`, the work in `roundpipe.train.loop`, the drawing in
`roundpipe.train.report`; this module only maps flags onto config fields (a flag given on the
command line overrides the ``--config`` file, which overrides what a ``--resume`` checkpoint was
trained with, which overrides the defaults) and picks where output goes. It must never import
torch at import time (``roundpipe --help`` stays fast) and never print a traceback for bad input:
it raises `roundpipe` errors and lets `roundpipe.cli.main` print one line and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from roundpipe.train.config import make_config, read_config_file

EXIT_INTERRUPTED = 130
EXIT_NON_FINITE = 3  # the loss became NaN/inf: stopped, last good checkpoint kept, nothing exported

# (flag, field, type, help); booleans are handled separately.
_OPTIONS: tuple[tuple[str, str, Any, str], ...] = (
    (
        "--model",
        "model",
        str,
        'preset name ("qwen3-tiny", "llama-tiny"), a config.json, or a model directory',
    ),
    ("--data", "data", str, "a .txt or .jsonl file to train on (default: the corpus shipped with roundpipe)"),
    ("--lora-r", "lora_r", int, "train only LoRA adapters of this rank on q/k/v/o (alpha = 2r)"),
    ("--devices", "devices", str, '"cpu:N" (default cpu:2), "cuda", "cuda:0,1", "auto", "fake:N"'),
    ("--microbatches", "microbatches", int, "microbatches per step (default 4)"),
    ("--batch-size", "batch_size", int, "sequences per step (default 16)"),
    ("--seq-len", "seq_len", int, "tokens per sequence (default 64)"),
    ("--steps", "steps", int, "optimizer steps in total, resumed ones included (default 200)"),
    ("--lr", "lr", float, "peak AdamW learning rate (default 1.5e-3)"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps, then cosine decay (default 20)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "the cosine ends at lr x this (default 0.1)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (default 0)"),
    ("--max-grad-norm", "max_grad_norm", float, "clip the global gradient norm (default: off)"),
    ("--precision", "precision", str, "fp32 (default), bf16 or fp16"),
    (
        "--async-warmup-steps",
        "async_warmup_steps",
        int,
        "async only: run the first N steps synchronously (default 20; 0 = off)",
    ),
    (
        "--weight-prediction",
        "weight_prediction",
        float,
        "async only: iterations read W + k*(W - W_prev) (default k = 2; 0 = off)",
    ),
    ("--seed", "seed", int, "model init, LoRA init, data order (default 0)"),
    ("--save-every", "save_every", int, "also save the checkpoint every N steps"),
    (
        "--keep-checkpoints",
        "keep_checkpoints",
        int,
        "keep the newest N checkpoints: checkpoint, then checkpoint-<step> (default 2)",
    ),
    ("--resume", "resume", str, "continue exactly from this checkpoint directory"),
    ("--export", "export", str, "at the end, save the model with save_pretrained into this directory"),
    ("--out", "out", str, "parent of the run directory (default runs)"),
    ("--name", "name", str, "run directory name (default: a timestamp)"),
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a model (no arguments: a small Qwen3 on the shipped corpus, on 2 CPU workers)",
        description=(
            "Train a causal language model with roundpipe. With no arguments it trains the built-in "
            "qwen3-tiny on the shipped corpus on two CPU workers in a few minutes. Writes "
            "<out>/<name>/ with metrics.jsonl, trace.json (Perfetto), schedule.json, timeline.png and a checkpoint. "
            "Ctrl-C saves a checkpoint; continue with --resume. See docs/train.md."
        ),
        argument_default=argparse.SUPPRESS,  # only flags actually given override the config
    )
    parser.add_argument(
        "--config", metavar="FILE", help="options from a YAML or JSON file (flags override it)"
    )
    for flag, dest, kind, text in _OPTIONS:
        parser.add_argument(flag, dest=dest, type=kind, help=text, metavar=dest.upper())
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--async", dest="async_optimizer", action="store_true", help="staleness-1 optimizer (default)"
    )
    mode.add_argument("--sync", dest="async_optimizer", action="store_false", help="synchronous optimizer")
    parser.add_argument(
        "--json",
        dest="json_output",
        action="store_true",
        help="print one JSON summary as the last line of stdout; everything else goes to stderr",
    )
    return parser


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The option values to validate: checkpoint's (on --resume) < --config file < flags."""
    flags = {dest: getattr(args, dest) for _, dest, _, _ in _OPTIONS if hasattr(args, dest)}
    if hasattr(args, "async_optimizer"):
        flags["async_optimizer"] = args.async_optimizer
    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    if getattr(args, "config", None):
        file_values = read_config_file(args.config)
        make_config(file_values, source=args.config)  # report a bad file as the file's fault
    resume = flags.get("resume", file_values.get("resume"))
    if resume:
        values.update(_saved_options(str(resume)))
    values.update(file_values)
    values.update(flags)
    return values


def _saved_options(checkpoint: str) -> dict[str, Any]:
    """The options the checkpoint's run was started with (empty if it was not made by train)."""
    from roundpipe.checkpoint import read_checkpoint_meta

    saved = read_checkpoint_meta(checkpoint).get("extra", {}).get("train_config")
    if not isinstance(saved, dict):
        return {}
    saved = dict(saved)
    saved.pop("resume", None)
    return saved


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    json_output = bool(getattr(args, "json_output", False))
    config = make_config(options(args))
    # With --json, stdout carries only the JSON line; people read stderr.
    console = Console(stderr=True) if json_output else Console(file=sys.stdout)
    from roundpipe.train.loop import train
    from roundpipe.train.report import RichReporter

    result = train(config, reporter=RichReporter(console, progress=True))
    if result.interrupted:
        console.print(
            f"[yellow]interrupted at step {result.steps}/{config.steps}; checkpoint saved to "
            f"{result.checkpoint}[/]\nresume with: roundpipe train --resume {result.checkpoint}",
            soft_wrap=True,
        )
    if json_output:
        print(json.dumps(result.summary()), flush=True)
    if result.non_finite:
        return EXIT_NON_FINITE
    return EXIT_INTERRUPTED if result.interrupted else 0


__all__ = ["add_parser", "options", "run"]
