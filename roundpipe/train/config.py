"""`TrainConfig`: every option of `roundpipe train`, validated in one place.

Why a pydantic model and not just argparse: the same options come from three places (defaults,
a ``--config`` YAML/JSON file, command-line flags, and on ``--resume`` the options saved in the
checkpoint) and must be merged, validated and saved the same way. A bad value or an unknown key
fails here, before any model is built, with a message naming the option as the user wrote it.

This module must never import torch or transformers (``roundpipe train --help`` stays fast) and
never touch the file system except to read the config file it is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from roundpipe.config import LayerIndices, PredictionFactors, RunConfig, WeightPrediction
from roundpipe.errors import ConfigError

DEFAULT_MODEL = "qwen3-tiny"
DATA_FIELDS = ("text", "prompt", "completion", "messages")  # as roundpipe.data.examples.FIELDS
# The async remedies `roundpipe train` uses unless told otherwise: the best combination measured
# on its default job (bench/async_quality.py, docs/performance.md "Asynchronous optimizer quality").
DEFAULT_ASYNC_WARMUP_STEPS = 20
DEFAULT_WEIGHT_PREDICTION: PredictionFactors = (2.0, -1.0)  # W + 2 (W - W_prev) - (W_prev - W_prev2)
DEFAULT_ASYNC_LR_RAMP_STEPS = 120
DEFAULT_ASYNC_LR_RAMP_START = 0.4


class TrainConfig(BaseModel):
    """Options of one training run; the defaults train the built-in demo in under 3 minutes on
    two CPU cores. See docs/train.md for each option."""

    model_config = ConfigDict(extra="forbid", validate_default=True, validate_assignment=True)

    model: str = Field(
        default=DEFAULT_MODEL, description="preset name, a local config.json, or a local model directory"
    )
    tokenizer: str | None = Field(
        default=None,
        description='a tokenizer directory, or "byte"; None = the model directory\'s own tokenizer '
        "(a preset or a bare config.json: the BPE tokenizer shipped with roundpipe)",
    )
    data: str | None = Field(
        default=None, description="a .txt or .jsonl file; None = the corpus shipped with roundpipe"
    )
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="column names of the data records: {'prompt': 'question', ...} (text, prompt, "
        "completion, messages)",
    )
    train_on_inputs: bool = Field(
        default=False, description="take the loss on prompts and user turns too (default: answers only)"
    )
    truncation: bool = Field(
        default=False, description="cut examples longer than seq_len (default: such an example is an error)"
    )
    packing: bool = Field(
        default=False, description="lay several short examples in one row, each attending only to itself"
    )
    eval_data: str | None = Field(default=None, description="a file to evaluate on (same formats as data)")
    eval_split: float | None = Field(
        default=None, gt=0, lt=1, description="hold out this fraction of the data to evaluate on"
    )
    eval_every: int | None = Field(
        default=None, ge=1, description="evaluate every N steps (always at the end when there is an eval set)"
    )
    report_to: Literal["auto", "tensorboard", "none"] = Field(
        default="auto", description="TensorBoard events in the run directory: auto = when installed"
    )
    lora_r: int | None = Field(
        default=None, ge=1, description="train LoRA adapters of this rank (alpha 2r) on q/k/v/o"
    )
    lora_experts: bool = Field(
        default=False,
        description="with lora_r on a mixture-of-experts model: adapters on the experts' weights too",
    )
    devices: str = Field(default="cpu:2", description='"auto", "cpu:N", "fake:N", "cuda", "cuda:0,1"')
    microbatches: int = Field(default=4, ge=1, description="microbatches per step")
    batch_size: int = Field(
        default=16, ge=1, description="sequences per step (the global batch under torchrun)"
    )
    seq_len: int | None = Field(
        default=None,
        ge=2,
        description="tokens per sequence; None = chosen from the data and the model when the run "
        "starts (64 for a text stream; for records, their longest, within the model's positions)",
    )
    steps: int = Field(default=200, ge=1, description="optimizer steps (in total, counting resumed ones)")
    lr: float = Field(default=1.5e-3, gt=0, description="peak learning rate of AdamW")
    warmup_steps: int = Field(default=20, ge=0, description="linear warmup steps before the cosine decay")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="the cosine decays to lr * min_lr_ratio")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float | None = Field(default=None, gt=0, description="clip the global gradient norm")
    precision: Literal["fp32", "bf16", "fp16"] = Field(default="fp32", description="compute precision")
    base_format: Literal["compute", "nf4"] = Field(
        default="compute",
        description="frozen base weights in the compute precision, or nf4 (4-bit, with lora_r)",
    )
    dequantize: Literal["auto", "run", "call"] = Field(
        default="auto",
        description="RunConfig.dequantize: nf4 weights made dense once per stage run, or per call",
    )
    profile: Literal["every_layer", "one_per_kind"] = Field(
        default="every_layer", description="RunConfig.profile: the device profile's layers before planning"
    )
    recompute_grain: Literal["auto", "stage", "layer", "layer_input"] = Field(
        default="auto", description="RunConfig.recompute_grain: what a backward stage recomputes from"
    )
    save_residuals: bool = Field(
        default=True, description="RunConfig.save_residuals: layer_input saves each layer's residual too"
    )
    async_optimizer: bool = Field(default=True, description="staleness-1 optimizer overlapping the next step")
    async_warmup_steps: int = Field(
        default=DEFAULT_ASYNC_WARMUP_STEPS,
        ge=0,
        description="async only: the first N steps run synchronously (docs/train.md, staleness remedies)",
    )
    weight_prediction: WeightPrediction = Field(
        default=DEFAULT_WEIGHT_PREDICTION,
        description="async only: iterations read W + k1 * (W - W_prev) + k2 * (W_prev - W_prev2), "
        "the factors newest first (one factor: W + k * (W - W_prev)); 0 turns it off",
    )
    async_lr_ramp_steps: int = Field(
        default=DEFAULT_ASYNC_LR_RAMP_STEPS,
        ge=0,
        description="async only: the first N asynchronous steps ramp the lr up from "
        "async_lr_ramp_start times its value (0 turns it off)",
    )
    async_lr_ramp_start: float = Field(
        default=DEFAULT_ASYNC_LR_RAMP_START,
        gt=0.0,
        le=1.0,
        description="async only: the lr ramp's first factor",
    )
    fresh_layers: int = Field(
        default=0,
        ge=0,
        description="async only: the deepest N layers read the newest weights (staleness 0); the "
        "next forward waits for their step, which the main job's one fused stage cannot hide",
    )
    fresh_at: LayerIndices = Field(
        default=(),
        description="async only: the layers at these indices (0: the embedding, 1: the first "
        "decoder block) read the newest weights (staleness 0); their next forward waits for their "
        "step (on a split plan the first stages wait for the last: `roundpipe simulate --fresh-at`)",
    )
    fresh_at_if_fused: LayerIndices = Field(
        default=(1,),
        description="async only: these layers also read the newest weights when the pipe's plan "
        "(made from the model's estimated costs) is one fused stage, where it costs only the first "
        "block's step between iterations (default 1: the first decoder block; none turns it off; "
        "docs/performance.md, 'The first block fresh')",
    )
    loss_lag: int = Field(
        default=1,
        ge=0,
        le=1,
        description="read each step's loss this many steps late (forward_backward(wait=False)): "
        "the next step is submitted while this one computes; 0 waits for every loss",
    )
    seed: int = Field(default=0, description="model init, LoRA init, data order and dropout")
    save_every: int | None = Field(default=None, ge=1, description="also save a checkpoint every N steps")
    keep_checkpoints: int = Field(
        default=2, ge=1, description="keep the newest N checkpoints (checkpoint, checkpoint-<step>, ...)"
    )
    resume: str | None = Field(default=None, description="continue from this checkpoint directory")
    overwrite: bool = Field(
        default=False,
        description="on --resume, continue in the run directory even if it holds newer checkpoints",
    )
    save_non_finite: bool = Field(
        default=False, description="when the loss turns NaN/inf, save that state aside for inspection"
    )
    export: str | None = Field(default=None, description="export the model (save_pretrained) here at the end")
    dist_timeout: float = Field(
        default=300.0,
        gt=0,
        description="under torchrun: a process that waits longer than this for another one fails, naming "
        "the ranks behind",
    )
    out: str = Field(default="runs", description="parent directory of run directories")
    name: str | None = Field(default=None, description="run directory name; default a timestamp")

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        # RunConfig owns the syntax of device strings; reuse its check and message.
        try:
            RunConfig(devices=value)
        except ConfigError as exc:
            message = str(exc).split("devices: ", 1)[-1]
            raise ValueError(message.rsplit(" (got ", 1)[0]) from None
        return value

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(DATA_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}; the fields are {', '.join(DATA_FIELDS)}")
        if any(not column.strip() for column in value.values()):
            raise ValueError("a column name must not be empty")
        return value

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or "/" in value or value in (".", "..") or os.sep in value):
            raise ValueError("must be a plain directory name (no '/')")
        return value

    @field_validator("model", "tokenizer", "data", "eval_data", "resume", "export", "out")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _check_lora(self) -> TrainConfig:
        if self.lora_experts and self.lora_r is None:
            raise ValueError("--lora-experts adds expert adapters to a LoRA run: give --lora-r R too")
        return self

    @model_validator(mode="after")
    def _check_eval(self) -> TrainConfig:
        if self.eval_data is not None and self.eval_split is not None:
            raise ValueError("give --eval-data or --eval-split, not both")
        if self.eval_every is not None and self.eval_data is None and self.eval_split is None:
            raise ValueError("--eval-every needs an eval set: --eval-data FILE or --eval-split 0.05")
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> TrainConfig:
        if self.microbatches > self.batch_size:
            raise ValueError(
                f"microbatches={self.microbatches} exceeds batch_size={self.batch_size}; "
                "each microbatch needs at least one sequence"
            )
        return self

    def run_config(self) -> RunConfig:
        """The `RunConfig` of the pipe this training run drives."""
        return RunConfig(
            devices=self.devices,
            num_microbatches=self.microbatches,
            async_optimizer=self.async_optimizer,
            # Remedies of staleness: nothing to remedy in sync mode (RunConfig refuses them there).
            async_warmup_steps=self.async_warmup_steps if self.async_optimizer else 0,
            weight_prediction=self.weight_prediction if self.async_optimizer else 0.0,
            async_lr_ramp_steps=self.async_lr_ramp_steps if self.async_optimizer else 0,
            async_lr_ramp_start=self.async_lr_ramp_start,
            fresh_layers=self.fresh_layers if self.async_optimizer else 0,
            fresh_at=self.fresh_at if self.async_optimizer else (),
            fresh_at_if_fused=self.fresh_at_if_fused if self.async_optimizer else (),
            loss_lag=self.loss_lag,
            precision=self.precision,
            base_format=self.base_format,
            dequantize=self.dequantize,
            profile=self.profile,
            recompute_grain=self.recompute_grain,
            save_residuals=self.save_residuals,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            distributed={"timeout_s": self.dist_timeout},
        )

    @property
    def tokens_per_step(self) -> int:
        """Token slots per step, padding included (the run's seq_len must be chosen by then)."""
        if self.seq_len is None:
            raise ConfigError("seq_len is chosen from the data when the run starts; set it first")
        return self.batch_size * self.seq_len


def option_name(field: str) -> str:
    """How the user writes a field on the command line: ``seq_len`` -> ``--seq-len``."""
    if field == "async_optimizer":
        return "--sync/--async"
    if field == "fields":
        return "--field"
    return "--" + field.replace("_", "-")


def make_config(values: Mapping[str, Any], *, source: str | None = None) -> TrainConfig:
    """Validate ``values`` into a `TrainConfig`, raising `ConfigError` with one line per problem."""
    prefix = f"{source}: " if source else ""
    unknown = sorted(set(values) - set(TrainConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"{prefix}unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"known options: {', '.join(TrainConfig.model_fields)}"
        )
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise _config_error(exc, prefix) from None


def _config_error(exc: ValidationError, prefix: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where = f"{option_name(loc[0])}" if loc else "config"
        message = err["msg"].removeprefix("Value error, ")
        if loc:
            lines.append(f"{where}: {message} (got {err.get('input')!r})")
        else:
            lines.append(message)
    if len(lines) == 1:
        return ConfigError(prefix + lines[0])
    return ConfigError(f"{prefix}{len(lines)} invalid options:\n  " + "\n  ".join(lines))


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Options from a YAML (.yaml/.yml) or JSON (.json) file: a mapping of option names
    (``seq_len`` or ``seq-len``) to values. Unknown names are rejected later by `make_config`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file {str(p)!r} does not exist" if not p.exists() else f"{p} is not a file"
        )
    text = p.read_text(encoding="utf-8")
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text) if text.strip() else {}
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file {p} must end in .yaml, .yml or .json")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc})") from None
    except ConfigError:
        raise
    except Exception as exc:  # yaml.YAMLError and friends: report, never a traceback
        raise ConfigError(f"{p}: not valid YAML ({exc})".replace("\n", " ")) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of option names to values, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "sync":  # the flag's name; the option is async_optimizer
            name, value = "async_optimizer", not value if isinstance(value, bool) else value
        elif name == "async":
            name = "async_optimizer"
        out[name] = value
    return out


__all__ = ["DEFAULT_MODEL", "TrainConfig", "make_config", "option_name", "read_config_file"]
