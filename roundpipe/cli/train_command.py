"""The ``roundpipe train`` subcommand: parse options, merge them, call `roundpipe.train.train`.

Why thin: the options live in `TrainConfig`, the work in `roundpipe.train.trainer`, the drawing in
`roundpipe.train.report`; this module only maps flags onto config fields (a flag given on the
command line overrides the ``--config`` file, which overrides what a ``--resume`` checkpoint was
trained with, which overrides the defaults) and picks where output goes. It must never import
torch at import time (``roundpipe --help`` stays fast) and never print a traceback for bad input:
it raises `roundpipe` errors and lets `roundpipe.cli.main` print one line and return 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from roundpipe.errors import ConfigError
from roundpipe.train.config import make_config, read_config_file

# Exit codes: 0 done; 2 bad input (roundpipe.cli); 3 the loss or gradient norm became NaN/inf
# (stopped, last good checkpoint kept, nothing exported); 128 + N stopped by signal N after saving
# (130 Ctrl-C, 143 SIGTERM). See TrainResult.exit_code.
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_NON_FINITE = 3
RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: 0, then 1, 2... per restart

# (flag, field, type, help); booleans are handled separately.
_OPTIONS: tuple[tuple[str, str, Any, str], ...] = (
    (
        "--model",
        "model",
        str,
        'preset name ("qwen3-tiny", "llama-tiny"), a config.json, or a model directory',
    ),
    (
        "--tokenizer",
        "tokenizer",
        str,
        "a tokenizer directory or 'byte' (default: the model directory's own; for a preset or a "
        "bare config.json the BPE tokenizer shipped with roundpipe)",
    ),
    (
        "--data",
        "data",
        str,
        "a .txt, .jsonl, .json, .parquet or .csv file to train on, or a hub dataset name where reachable (default: the corpus shipped with roundpipe)",
    ),
    ("--eval-data", "eval_data", str, "a file to evaluate on, in the formats --data takes"),
    ("--eval-split", "eval_split", float, "hold out this fraction of --data (e.g. 0.05) to evaluate on"),
    ("--eval-every", "eval_every", int, "evaluate every N steps (and always at the end)"),
    (
        "--report-to",
        "report_to",
        str,
        "tensorboard (event files in the run directory), none, or auto (default: tensorboard when installed)",
    ),
    ("--lora-r", "lora_r", int, "train only LoRA adapters of this rank on q/k/v/o (alpha = 2r)"),
    ("--devices", "devices", str, '"cpu:N" (default cpu:2), "cuda", "cuda:0,1", "auto", "fake:N"'),
    ("--microbatches", "microbatches", int, "microbatches per step (default 4)"),
    (
        "--batch-size",
        "batch_size",
        int,
        "sequences per step, all processes together under torchrun (default 16)",
    ),
    (
        "--seq-len",
        "seq_len",
        int,
        "tokens per sequence (default: from the data and the model: 64 for a text file; for "
        "records, the longest example, within the model's max_position_embeddings)",
    ),
    ("--steps", "steps", int, "optimizer steps in total, resumed ones included (default 200)"),
    ("--lr", "lr", float, "peak AdamW learning rate (default 1.5e-3)"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps, then cosine decay (default 20)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "the cosine ends at lr x this (default 0.1)"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (default 0)"),
    ("--max-grad-norm", "max_grad_norm", float, "clip the global gradient norm (default: off)"),
    ("--precision", "precision", str, "fp32 (default), bf16 or fp16"),
    (
        "--base-format",
        "base_format",
        str,
        "frozen base weights: compute (default) or nf4 (4-bit; with --lora-r)",
    ),
    (
        "--dequantize",
        "dequantize",
        str,
        "nf4 weights made dense once per stage run (run), inside each layer call (call), or run "
        "where the plan fits so (auto, the default)",
    ),
    (
        "--recompute-grain",
        "recompute_grain",
        str,
        "what a backward stage recomputes from: auto (the default: layer_input on GPUs for LoRA on a "
        "dense model at least 4,096 wide with host room, else stage), stage, layer or layer_input",
    ),
    (
        "--profile",
        "profile",
        str,
        "layers the device profile runs before planning: every_layer (default) or one_per_kind "
        "(one of each kind: much shorter at long sequences)",
    ),
    (
        "--async-warmup-steps",
        "async_warmup_steps",
        int,
        "async only: run the first N steps synchronously (default 20; 0 = off)",
    ),
    (
        "--weight-prediction",
        "weight_prediction",
        str,
        "async only: iterations read W + k1*(W - W_prev) + k2*(W_prev - W_prev2), factors newest "
        "first (default 2,-1; one factor k: W + k*(W - W_prev); 0 = off)",
    ),
    (
        "--async-lr-ramp-steps",
        "async_lr_ramp_steps",
        int,
        "async only: ramp the lr of the first N async steps up from the start factor (default 120; 0 = off)",
    ),
    (
        "--async-lr-ramp-start",
        "async_lr_ramp_start",
        float,
        "async only: the lr ramp's first factor (default 0.4)",
    ),
    (
        "--fresh-layers",
        "fresh_layers",
        int,
        "async only: the deepest N layers read the newest weights, staleness 0 (default 0; the "
        "next forward waits for their step: `roundpipe simulate --fresh-layers` shows the cost)",
    ),
    (
        "--fresh-at",
        "fresh_at",
        str,
        "async only: these layers (0 = the embedding, 1 = the first decoder block; e.g. 1 or 1,2) "
        "read the newest weights, staleness 0 (default none; the next forward waits for their step)",
    ),
    (
        "--fresh-at-if-fused",
        "fresh_at_if_fused",
        str,
        "async only: these layers read the newest weights when the plan is one fused stage "
        "(default 1, the first decoder block: about 1 point of loss for its step between "
        "iterations; none turns it off)",
    ),
    (
        "--loss-lag",
        "loss_lag",
        int,
        "read each loss this many steps late, so the next step is submitted while this one "
        "computes (default 1; 0 = wait for every loss)",
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
    (
        "--dist-timeout",
        "dist_timeout",
        float,
        "under torchrun: seconds a process waits for the others before it fails naming the ranks "
        "behind (default 300)",
    ),
    ("--out", "out", str, "parent of the run directory (default runs)"),
    ("--name", "name", str, "run directory name (default: a timestamp)"),
)


# On/off options (store_true; the config field is the flag's name in snake case).
_SWITCHES: tuple[tuple[str, str], ...] = (
    (
        "--train-on-inputs",
        "take the loss on prompts and non-assistant turns too (default: completions and assistant turns)",
    ),
    ("--truncation", "cut examples longer than --seq-len (default: such an example is an error)"),
    (
        "--lora-experts",
        "with --lora-r on a mixture-of-experts model (Qwen3-MoE, GPT-OSS): LoRA on the experts' "
        "gate_up_proj and down_proj weights too",
    ),
    (
        "--packing",
        "lay short examples one after another in each row (position ids restart, no attention "
        "across examples) instead of one padded example a row",
    ),
    (
        "--overwrite",
        "with --resume of an older checkpoint: continue in its run directory and replace the "
        "newer checkpoints there (default: continue in a new run directory)",
    ),
    (
        "--save-non-finite",
        "when the loss or gradient norm turns NaN/inf, also save that state as "
        "<run>/non-finite-step-<N> for inspection (never over the last good checkpoint)",
    ),
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a model (no arguments: a small Qwen3 on the shipped corpus, on 2 CPU workers)",
        description=(
            "Train a causal language model with roundpipe. With no arguments it trains the built-in "
            "qwen3-tiny on the shipped corpus on two CPU workers in a few minutes. Writes "
            "<out>/<name>/ with metrics.jsonl, trace.json (Perfetto), schedule.json, timeline.png and a checkpoint. "
            "Ctrl-C saves a checkpoint; continue with --resume. Under torchrun (WORLD_SIZE > 1) each "
            "process trains on its share of every global --batch-size batch and rank 0 writes the run "
            "directory; after a torchrun restart a run with --name resumes from its last checkpoint. "
            "See docs/train.md and docs/distributed.md."
        ),
        argument_default=argparse.SUPPRESS,  # only flags actually given override the config
    )
    parser.add_argument(
        "--config", metavar="FILE", help="options from a YAML or JSON file (flags override it)"
    )
    for flag, dest, kind, text in _OPTIONS:
        parser.add_argument(flag, dest=dest, type=kind, help=text, metavar=dest.upper())
    parser.add_argument(
        "--field",
        dest="fields",
        action="append",
        metavar="FIELD=COLUMN",
        help="read FIELD (text, prompt, completion, messages) from COLUMN of the data records; repeatable",
    )
    for flag, text in _SWITCHES:
        parser.add_argument(flag, dest=flag[2:].replace("-", "_"), action="store_true", help=text)
    parser.add_argument(
        "--no-save-residuals",
        dest="save_residuals",
        action="store_false",
        help="layer_input grain saves each layer's input alone, not its post-attention residual beside "
        "it (less host memory; each recompute then computes o_proj)",
    )
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
    for name in (
        "async_optimizer",
        "overwrite",
        "save_non_finite",
        "train_on_inputs",
        "truncation",
        "packing",
        "lora_experts",
        "save_residuals",
    ):
        if hasattr(args, name):
            flags[name] = getattr(args, name)
    if hasattr(args, "fields"):
        flags["fields"] = _fields(args.fields)
    values: dict[str, Any] = {}
    file_values: dict[str, Any] = {}
    if getattr(args, "config", None):
        file_values = read_config_file(args.config)
        make_config(file_values, source=args.config)  # report a bad file as the file's fault
    resume = flags.get("resume", file_values.get("resume"))
    if resume:
        resume = _checkpoint_of(str(resume))
        values.update(_saved_options(resume))
    values.update(file_values)
    values.update(flags)
    if resume:
        values["resume"] = resume
    if not resume:
        restart_from = _elastic_resume(values)
        if restart_from is not None:
            values = {**_saved_options(restart_from), **values, "resume": restart_from}
    return values


def _elastic_resume(values: dict[str, Any]) -> str | None:
    """After a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) of a run with ``--name``
    and no ``--resume``: resume from the run's last checkpoint, when it has one. Returns the path
    (for ``values["resume"]``) or None."""
    if int(os.environ.get(RESTART_VARIABLE, "0") or 0) < 1 or values.get("resume") or not values.get("name"):
        return None
    checkpoint = Path(str(values.get("out", "runs"))).expanduser() / str(values["name"]) / "checkpoint"
    if not (checkpoint / "meta.json").is_file():
        return None
    print(
        f"roundpipe train: restart {os.environ[RESTART_VARIABLE]} by torchrun: resuming from {checkpoint}",
        file=sys.stderr,
        flush=True,
    )
    return str(checkpoint)


def _checkpoint_of(path: str) -> str:
    """The checkpoint ``--resume`` means: a run directory (runs/NAME) gives its newest intact one."""
    from roundpipe.checkpoint.find import resolve_checkpoint

    checkpoint, note = resolve_checkpoint(path)
    if note:
        print(f"roundpipe train: {note}", file=sys.stderr, flush=True)
    return str(checkpoint)


def _fields(values: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for value in values:
        key, sep, column = value.partition("=")
        if not sep:
            raise ConfigError(f"--field {value!r}: expected FIELD=COLUMN, e.g. --field prompt=question")
        fields[key.strip()] = column.strip()
    return fields


def _saved_options(checkpoint: str) -> dict[str, Any]:
    """The options the checkpoint's run was started with (empty if it was not made by train)."""
    from roundpipe.checkpoint import read_checkpoint_meta

    saved = read_checkpoint_meta(checkpoint).get("extra", {}).get("train_config")
    if not isinstance(saved, dict):
        return {}
    saved = dict(saved)
    saved.pop("resume", None)
    saved.pop("overwrite", None)  # a decision about one resume, never inherited by the next
    saved.setdefault("async_lr_ramp_steps", 0)  # saved before the lr ramp existed: it ran without
    saved.setdefault("fresh_at_if_fused", ())  # saved before it existed: every layer stale
    return saved


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    json_output = bool(getattr(args, "json_output", False))
    config = make_config(options(args))
    # With --json, stdout carries only the JSON line; people read stderr.
    console = Console(stderr=True) if json_output else Console(file=sys.stdout)
    from roundpipe.faults import fault_point

    fault_point("startup")  # tests: a Ctrl-C before torch and the training code are loaded
    from roundpipe.train.report import RichReporter
    from roundpipe.train.trainer import train

    result = train(config, reporter=RichReporter(console, progress=True))
    if result.rank:  # under torchrun rank 0 reports for every process
        return result.exit_code
    if result.interrupted and not result.non_finite:
        by = f" by {result.stop_signal}" if result.stop_signal else ""
        console.print(
            f"[yellow]interrupted{by} at step {result.steps}/{config.steps}; checkpoint saved to "
            f"{result.checkpoint}[/]\nresume with: roundpipe train --resume {result.checkpoint}",
            soft_wrap=True,
        )
    if json_output:
        print(json.dumps(result.summary()), flush=True)
    return result.exit_code


__all__ = ["add_parser", "options", "run"]
