"""Every user-facing knob of a run, validated in one place.

Why pydantic: a bad value should fail when the config is built, with a message that names the
field, what was given and what is accepted, not deep inside a worker thread. Factories (the
optimizer, the LR scheduler, the loss function) are not configuration: they are arguments of
`RoundPipe`, so a `RunConfig` stays plain data that can be saved in a checkpoint and compared.

This module must never import torch at import time or touch devices.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from roundpipe.distributed_config import DistributedConfig
from roundpipe.errors import ConfigError
from roundpipe.plan.sizes import parse_bytes

Precision = Literal["fp32", "bf16", "fp16"]
_DEVICES_HELP = '"auto", "cpu:N", "fake:N", "cuda" or "cuda:0,1"'


@dataclass(frozen=True)
class DeviceSpec:
    """Parsed ``devices`` string: backend kind and device indices."""

    kind: Literal["cpu", "fake", "cuda"]
    indices: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.indices)


def parse_devices(value: str) -> DeviceSpec:
    """``"cpu:2"`` -> cpu workers 0,1; ``"cuda:0,2"`` -> cuda 0 and 2; ``"auto"`` -> every CUDA
    device when there is one, else two CPU workers. ``"cuda"`` and ``"auto"`` started by torchrun
    with several processes on this machine take this process's share of the visible GPUs
    (`local_share`); devices named by index are used as named."""
    text = value.strip().lower()
    if text == "auto":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return DeviceSpec("cuda", local_share(torch.cuda.device_count(), value))
        return DeviceSpec("cpu", (0, 1))
    match = re.fullmatch(r"(cpu|fake):(\d+)", text)
    if match:
        count = int(match.group(2))
        if count < 1:
            raise ConfigError(f'devices={value!r}: need at least one worker, e.g. "{match.group(1)}:2"')
        return DeviceSpec(match.group(1), tuple(range(count)))  # type: ignore[arg-type]
    if text == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                'devices="cuda" but no CUDA device is visible; use devices="cpu:2" to run on CPU'
            )
        return DeviceSpec("cuda", local_share(count, value))
    match = re.fullmatch(r"cuda:(\d+(?:\s*,\s*\d+)*)", text)
    if match:
        indices = tuple(int(i) for i in match.group(1).split(","))
        if len(set(indices)) != len(indices):
            raise ConfigError(f"devices={value!r} names a device twice")
        return DeviceSpec("cuda", indices)
    raise ConfigError(f"devices={value!r} is not understood; use {_DEVICES_HELP}")


def local_processes(environ: Mapping[str, str] | None = None) -> int:
    """How many processes torchrun started on this machine (``LOCAL_WORLD_SIZE``; 1 without it)."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_WORLD_SIZE", "1") or 1)


def local_share(count: int, value: str, environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """This process's GPUs among ``count`` visible ones: all of them, or, under torchrun with
    ``LOCAL_WORLD_SIZE`` > 1 processes on this machine, the ``LOCAL_RANK``-th of that many equal,
    contiguous groups. Why: every process of ``torchrun --nproc-per-node 2`` sees every GPU of the
    machine, and two processes driving the same GPUs would share their memory and compute while
    each plans as if it had them alone."""
    env = os.environ if environ is None else environ
    processes = local_processes(env)
    if processes <= 1:
        return tuple(range(count))
    rank = int(env.get("LOCAL_RANK", "0") or 0)
    if count < processes or count % processes:
        raise ConfigError(
            f"devices={value!r}: {processes} processes on this machine (torchrun's LOCAL_WORLD_SIZE) "
            f"cannot share {count} visible GPU(s) equally; start a number of processes that divides "
            f'{count}, or name each process\'s GPUs (devices="cuda:0" on one, "cuda:1" on the other)'
        )
    share = count // processes
    return tuple(range(rank * share, (rank + 1) * share))


MAX_PREDICTION_FACTORS = 3
PredictionFactors = float | tuple[float, ...]


def prediction_factors(value: Any) -> PredictionFactors:
    """``weight_prediction`` as given (a number, a sequence of numbers, or ``"2,-1"``) in its one
    form: 0.0 when off, a float for one factor, a tuple for several. Raises ValueError naming
    what is wrong."""
    if isinstance(value, str):
        try:
            value = tuple(float(part) for part in value.split(","))
        except ValueError:
            raise ValueError(
                f"{value!r} is no factor (2) or list of factors of the last updates, newest first (2,-1)"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float | tuple | list):
        raise ValueError(f"give a number or a sequence of numbers, not {value!r}")
    factors = (float(value),) if isinstance(value, int | float) else tuple(float(k) for k in value)
    if not any(factors):
        return 0.0
    if len(factors) > MAX_PREDICTION_FACTORS:
        raise ValueError(
            f"at most {MAX_PREDICTION_FACTORS} factors, not {len(factors)} (each keeps one more fp32 copy of "
            "the trainable weights on the host)"
        )
    if not 0.0 < factors[0] <= 4.0:
        raise ValueError(
            f"the factor of the last update must be in (0, 4], not {factors[0]:g} (0 alone turns "
            "prediction off)"
        )
    if any(not -4.0 <= k <= 4.0 for k in factors[1:]):
        raise ValueError(f"the factors of earlier updates must be in [-4, 4], not {factors[1:]}")
    return factors[0] if len(factors) == 1 else factors


WeightPrediction = Annotated[PredictionFactors, pydantic.BeforeValidator(prediction_factors)]
"""The ``weight_prediction`` field of `RunConfig` and `TrainConfig`: any accepted form, stored in one."""


def layer_indices(value: Any) -> tuple[int, ...]:
    """``fresh_at`` as given (an index, a sequence of indices, ``"1,2"``, or ``""`` / ``"none"``
    for none) in its one form: a sorted tuple. Raises ValueError naming what is wrong."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none"):
            return ()
        try:
            value = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"{value!r} is no layer index (1) or list of them (1,2)") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, tuple | list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in value
    ):
        raise ValueError(f"give layer indices (ints), not {value!r}")
    if any(i < 0 for i in value):
        raise ValueError(f"layer indices count from 0 (the first layer, the embedding), not {list(value)}")
    if len(set(value)) != len(value):
        raise ValueError(f"each layer once, not {list(value)}")
    return tuple(sorted(value))


LayerIndices = Annotated[tuple[int, ...], pydantic.BeforeValidator(layer_indices)]
"""The ``fresh_at`` field of `RunConfig` and `TrainConfig`: any accepted form, stored sorted."""


class RunConfig(BaseModel):
    """How a `RoundPipe` runs. Every field has a default; see docs/api.md for each."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    devices: str = Field("cpu:2", description=f"where stages run: {_DEVICES_HELP}")
    num_microbatches: int = Field(
        4, ge=1, description="microbatches each forward_backward splits its batch into"
    )
    async_optimizer: bool = Field(
        True, description="True: staleness-1 CPU optimizer overlapping the next iteration"
    )
    async_warmup_steps: int = Field(
        0,
        ge=0,
        description="async remedy: run the first N optimizer steps synchronously, then staleness 1",
    )
    weight_prediction: WeightPrediction = Field(
        0.0,
        description="async remedy: iterations read the weights extrapolated by the last updates, "
        "W + k * (W - W_prev) with k this factor, or with factors (k1, k2) also + k2 * (W_prev - "
        "W_prev2) (up to 3; 0: off)",
    )
    async_lr_ramp_steps: int = Field(
        0,
        ge=0,
        description="async remedy: the first N asynchronous steps run at a fraction of the learning "
        "rate, rising linearly from async_lr_ramp_start to 1 (PipeMare-style; 0: off)",
    )
    async_lr_ramp_start: float = Field(
        0.4, gt=0.0, le=1.0, description="async remedy: the lr ramp's first factor (see async_lr_ramp_steps)"
    )
    fresh_layers: int = Field(
        0,
        ge=0,
        description="async remedy: the deepest N layers read the newest weights (staleness 0; a "
        "layer sharing weights with a shallower one, such as a tied LM head, stays stale); their "
        "next forward waits for their step, which costs nothing when it lands before the forward "
        "reaches them (`roundpipe.planning.simulate` shows whether it does)",
    )
    fresh_at: LayerIndices = Field(
        (),
        description="async remedy: the layers at these indices of the pipe's layer sequence (0: the "
        "first, the embedding of a transformers model; 1: its first decoder block) read the newest "
        "weights, as fresh_layers does for the deepest ones; a listed layer sharing weights with an "
        "unlisted one is refused. Their next forward waits for their step: on a plan of one fused "
        "stage that is their step's host time, on a split plan the first stages wait for the last",
    )
    fresh_at_if_fused: LayerIndices = Field(
        (),
        description="async remedy: as fresh_at, but only when the plan made at construction (from "
        "the model's estimated costs, never from timings) is one fused stage of every layer, where "
        "a fresh layer costs only its step's host time between iterations; on a split plan the "
        "first stages would wait for the last, and these layers stay one step behind",
    )
    loss_lag: int = Field(
        0,
        ge=0,
        le=1,
        description="how many iterations late the training loop reads each loss: 0, forward_backward "
        "waits for it; 1, the loop reads it after submitting the next iteration "
        "(forward_backward(..., wait=False)). The planner times plans as such a loop submits them",
    )
    precision: Precision = Field("fp32", description="dtype of the compute copy and of device math")
    base_format: Literal["compute", "nf4"] = Field(
        "compute",
        description='how frozen linear weights are held on the host and uploaded: "compute", in the '
        'compute precision; "nf4", in 4-bit NormalFloat (QLoRA), quantized at construction layer by '
        "layer and dequantized on the device, as dequantize says (a LoRA base: needs frozen linears)",
    )
    dequantize: Literal["auto", "run", "call"] = Field(
        "auto",
        description='when a frozen 4-bit weight (base_format="nf4") becomes dense on the device: "run", '
        "once per stage run, the copy kept for all its microbatches (the plan counts the stage's "
        'dense weights, so its stages are smaller); "call", inside each layer call (forward, '
        'recompute and backward each: the least memory); "auto", "run" where a plan fits the '
        'memory budget with it, else "call" (on CUDA one device\'s fused stage may dequantize in '
        "each call where that holds more layers and runs faster)",
    )
    max_grad_norm: float | None = Field(None, gt=0, description="clip the global gradient norm to this value")
    loss_scale: Literal["dynamic", "none"] | float = Field(
        "dynamic", description='fp16 only: "dynamic" loss scaling, "none", or a fixed scale'
    )
    round_size: int | None = Field(None, ge=1, description="microbatches per round (>= number of devices)")
    chunk_bytes: int | None = Field(256 << 20, ge=1, description="split parameter uploads larger than this")
    recompute_grain: Literal["auto", "stage", "layer", "layer_input"] = Field(
        "auto",
        description='backward recompute granularity: "stage" recomputes a backward stage from its input; '
        '"layer" one layer at a time, deepest first (the least memory); "layer_input" every layer from '
        "its own input, which the forward stage saved to the host (more host memory and link bytes; "
        "every layer's recompute then skips its unread tail, skip_unread_tail); "
        '"auto", on CUDA, "layer_input" where every decoder layer ends in a frozen dense down_proj (LoRA, '
        "QLoRA) of a model at least 4,096 wide, a plan fits with it and one round's saved inputs take at "
        'most half the host\'s available memory, else "stage" (roundpipe.planning.grain)',
    )
    skip_unread_tail: bool = Field(
        True,
        description="a backward stage's recompute leaves out the frozen down projection that ends its "
        "last layer (every layer's with recompute_grain 'layer' or 'layer_input'; in a mixture-of-experts "
        "layer its frozen experts' down products and the sum of the choices): the backward never reads its "
        "value, so the gradients are the same (the experts' to fp32 rounding); False computes it",
    )
    save_residuals: bool = Field(
        True,
        description="with recompute_grain 'layer_input', forward stages also save each decoder layer's "
        "post-attention residual beside its input, so its recompute leaves out the frozen o_proj product "
        "too (one hidden state more a layer each way; the gradients equal the full recompute's to rounding); "
        "under 'auto' only where one round's inputs and residuals fit the host room, else the inputs alone "
        "(roundpipe.model.attention_residual); needs skip_unread_tail",
    )
    mem_limit_bytes: int | None = Field(
        None,
        ge=1,
        description="old per-stage-pair cap: the bytes of a stage and its prefetched successor, summed "
        "per layer by the partitioner; memory_budget is the device's whole budget and supersedes it",
    )
    memory_budget: int | str | None = Field(
        None,
        description='per-device memory budget, bytes or a size such as "24GiB" or "512MiB": the plan '
        "keeps each device's predicted peak (parameters, gradients, activations, prefetch) under it, "
        "and on CUDA a budget below the card's memory is enforced, so a big card can stand in for a "
        "small one. None: on CUDA the free memory at start less a reserve; unlimited on cpu and fake",
    )
    seed: int = Field(0, description="seeds dropout; the same seed gives the same run on any device count")
    trace_iterations: int = Field(8, ge=0, description="how many recent iterations the trace keeps")
    stall_timeout_s: float | None = Field(
        600.0, gt=0, description="watchdog: fail if no task finishes this long"
    )
    replan: bool = Field(True, description="re-partition after the first iteration from measured layer times")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description='torch.compile the layers: "auto" compiles the decoder layers and the loss kernel of '
        "transformers models on CUDA (when triton is installed); True also every other layer and on any "
        "device; False runs everything eagerly",
    )
    profile: Literal["every_layer", "one_per_kind"] = Field(
        "every_layer",
        description='what the device profile before planning runs: "every_layer" each layer once; '
        '"one_per_kind" the first layer of each kind (class, parameter and input shapes, attention type), '
        "the others taking its figures: at long sequences the profile of every layer lasts as long as a step",
    )

    distributed: DistributedConfig = Field(
        default_factory=lambda: DistributedConfig.model_validate({}),
        description="data parallel across processes (torch.distributed): docs/distributed.md",
    )

    def __init__(self, **values: Any) -> None:
        # Raise our ConfigError (a ValueError) with one line per bad field instead of pydantic's.
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(exc) from None

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        text = value.strip().lower()
        if text in ("auto", "cuda"):
            return text
        if re.fullmatch(r"(cpu|fake):\d+", text) or re.fullmatch(r"cuda:\d+(\s*,\s*\d+)*", text):
            if text.endswith(":0") and not text.startswith("cuda"):
                raise ValueError(f'{value!r} asks for zero workers; use at least 1, e.g. "cpu:2"')
            return text
        raise ValueError(f"{value!r} is not understood; use {_DEVICES_HELP}")

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _check_memory_budget(cls, value: Any) -> Any:
        if value is not None:
            parse_bytes(value)  # raises with the accepted spellings; the value is kept as given
        return value

    @field_validator("loss_scale")
    @classmethod
    def _check_loss_scale(cls, value: Any) -> Any:
        if isinstance(value, float | int) and not isinstance(value, bool) and value <= 0:
            raise ValueError("a fixed loss scale must be > 0")
        return value

    @model_validator(mode="after")
    def _check_async_remedies(self) -> RunConfig:
        if not self.async_optimizer:
            given = [
                f"{name}={getattr(self, name)}"
                for name in (
                    "async_warmup_steps",
                    "weight_prediction",
                    "async_lr_ramp_steps",
                    "fresh_layers",
                    "fresh_at",
                    "fresh_at_if_fused",
                )
                if getattr(self, name)
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only applies with async_optimizer=True (sync mode has no "
                    "staleness to remedy); remove it or set async_optimizer=True"
                )
        return self

    @model_validator(mode="after")
    def _check_round_size(self) -> RunConfig:
        if self.round_size is not None and self.round_size > self.num_microbatches:
            raise ValueError(
                f"round_size={self.round_size} exceeds num_microbatches={self.num_microbatches}; "
                "a round holds at most all microbatches"
            )
        return self

    def device_spec(self) -> DeviceSpec:
        return parse_devices(self.devices)

    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (``"24GiB"`` -> 25769803776); None when not set."""
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)


def config_error(exc: ValidationError) -> ConfigError:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        lines.append(f"{field}: {msg} (got {given!r})")
    return ConfigError("invalid RunConfig:\n  " + "\n  ".join(lines))
