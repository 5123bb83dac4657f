"""How a `RunConfig` becomes the parts `RoundPipe` wires together: the host copies, the loss
scaler, the runtime, the cost estimates and the backend (the plan is `roundpipe.planning.replan`'s).

Why apart from the facade: each choice here is a small rule of its own (which backend a device
string names, when fp16 needs a loss scale, what a layer costs before anything was measured) and the facade reads better as the wiring of
their results. Backends are imported only when chosen, so a machine without CUDA never imports
the CUDA backend.

It must never start threads, submit tasks or keep state: every function returns a new part.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from roundpipe.config import RunConfig
from roundpipe.errors import ConfigError
from roundpipe.model.sequence import LayerSequence
from roundpipe.optim.distributed import make_collectives
from roundpipe.optim.host import HostModel, LossScaler, OptimizerFactory, SchedulerFactory
from roundpipe.optim.lr_ramp import ramp_factor
from roundpipe.plan import LayerCosts
from roundpipe.planning.device_plan import may_save_residuals
from roundpipe.planning.grain import initial_grain
from roundpipe.sched.spec import ScheduleOptions, fresh_layer_set, fresh_units_at

if TYPE_CHECKING:
    from roundpipe.backends.runtime import Runtime

UPLOAD_PARTS_AHEAD: int | None = None
"""`ScheduleOptions.upload_parts_ahead` of every run of the process: None until a GPU has measured
a limit (`roundpipe.sched.param_uploads`; `bench/gpu_throughput.py --upload-parts-ahead` sets it
for one run)."""


def make_host(
    sequence: LayerSequence,
    config: RunConfig,
    optimizer: OptimizerFactory | None,
    lr_scheduler: SchedulerFactory | None,
) -> HostModel:
    return HostModel(
        sequence.layers,
        sequence.source,
        precision=config.precision,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        # Pinned host memory is what makes uploads to a GPU asynchronous and fast.
        pin_memory=torch.cuda.is_available(),
        weight_prediction=config.weight_prediction if config.async_optimizer else 0.0,
    )


def make_scaler(config: RunConfig) -> LossScaler | None:
    """fp16 needs a loss scale (dynamic unless a number is given); other precisions none."""
    if config.precision != "fp16" or config.loss_scale == "none":
        return None
    if config.loss_scale == "dynamic":
        return LossScaler()
    return LossScaler(scale=float(config.loss_scale), dynamic=False)


def make_runtime(
    host: HostModel, sequence: LayerSequence, config: RunConfig, scaler: LossScaler | None, kind: str
) -> Runtime:
    from roundpipe.backends.compiling import LayerCompiler
    from roundpipe.backends.runtime import Runtime

    runtime = Runtime(
        host,
        sequence.names,
        computes_loss=sequence.computes_loss,
        recompute_grain=initial_grain(config),
        seed=config.seed,
        max_grad_norm=config.max_grad_norm,
        scaler=scaler,
        chunk_bytes=config.chunk_bytes,
        compiler=LayerCompiler(config.compile, kind),
        predict_from=predict_from(config),
        lr_scale=lr_ramp(config),
    )
    runtime.collectives = make_collectives(config.distributed, host)
    runtime.skip_unread_tail = config.skip_unread_tail
    # Until a device plan says (from the residuals its profile measured); only layer_input reads it.
    runtime.save_residuals = may_save_residuals(config, kind, sequence.layers)
    # Until a device plan says otherwise (`record_device_plan`): no budget to decide against. A
    # model may arrive holding 4-bit weights whatever base_format says.
    runtime.dense.enabled = config.dequantize != "call" and runtime.dense.holds_quantized()
    return runtime


def schedule_options(
    config: RunConfig,
    round_size: int | None,
    runtime: Runtime,
    owners: tuple[tuple[int, ...], ...],
    *,
    one_fused_stage: bool = False,
) -> ScheduleOptions:
    """The task graph's knobs: a grad-norm barrier when clipping or fp16 needs the global norm,
    one order of the steps on every process when they average gradients, and the fresh units of
    ``config.fresh_layers``, ``config.fresh_at`` and, when the plan is ``one_fused_stage``,
    ``config.fresh_at_if_fused`` (given the layers' ``owners``)."""
    return ScheduleOptions(
        async_optimizer=config.async_optimizer,
        round_size=round_size,
        chunk_bytes=config.chunk_bytes,
        grad_norm_barrier=config.max_grad_norm is not None or runtime.scaler is not None,
        ordered_steps=runtime.collectives.active,
        sync_steps=config.async_warmup_steps if config.async_optimizer else 0,
        fresh_units=fresh_units(config, owners, one_fused_stage=one_fused_stage),
        layer_inputs=runtime.recompute_grain == "layer_input",
        layer_residuals=runtime.recompute_grain == "layer_input" and runtime.save_residuals,
        upload_parts_ahead=UPLOAD_PARTS_AHEAD,
    )


def fresh_units(
    config: RunConfig, owners: tuple[tuple[int, ...], ...], *, one_fused_stage: bool = False
) -> frozenset[int]:
    """The units that read fresh weights: those of the deepest ``config.fresh_layers`` layers and
    of the layers ``config.fresh_at`` lists (with ``config.fresh_at_if_fused`` on a plan of
    ``one_fused_stage``) that share no weights with another layer (`fresh_units_at`). A tied head
    among the deepest layers stays stale with its embedding, as documented; a listed layer that
    cannot be fresh is an error (it was asked for by name)."""
    conditional = config.fresh_at_if_fused if one_fused_stage else ()
    listed = tuple(sorted({*config.fresh_at, *conditional}))
    if not config.async_optimizer or not (config.fresh_layers or listed):
        return frozenset()
    field = "fresh_at (with fresh_at_if_fused)" if conditional else "fresh_at"
    count = len(owners)
    if config.fresh_layers > count:
        raise ConfigError(
            f"fresh_layers={config.fresh_layers} but the model has {count} layers (embedding "
            f"and LM head included); use at most {count}"
        )
    if listed and listed[-1] >= count:
        raise ConfigError(
            f"{field}={list(listed)} but the model has {count} layers, 0 to {count - 1} "
            "(0 is the embedding of a transformers model, 1 its first decoder block)"
        )
    layers = fresh_layer_set(count, config.fresh_layers, listed)
    units = fresh_units_at(owners, layers)
    for layer in listed:
        if not all(unit in units for unit in owners[layer]):
            sharing = sorted(
                {other for other, held in enumerate(owners) if set(held) & set(owners[layer])} - layers
            )
            raise ConfigError(
                f"{field} lists layer {layer}, whose weights layer(s) {sharing} share (a tied "
                f"embedding and LM head, say) and which stay stale: one weight version is read "
                f"for both, so list {sharing} too or leave {layer} out"
            )
    return units


def predict_from(config: RunConfig) -> int | None:
    """The first step whose P-copy predicts: the first deferred one (the async warm-up's P-copies
    run right after their steps and copy exact weights); None without prediction."""
    if not config.async_optimizer or not config.weight_prediction:
        return None
    return max(0, config.async_warmup_steps - 1)


def lr_ramp(config: RunConfig) -> Callable[[int], float]:
    """The async lr ramp's factor per optimizer step (1 everywhere when it is off)."""
    steps = config.async_lr_ramp_steps if config.async_optimizer else 0
    return partial(
        ramp_factor, first_async=config.async_warmup_steps, steps=steps, start=config.async_lr_ramp_start
    )


def make_backend(kind: str, indices: tuple[int, ...], runtime: Runtime, costs: LayerCosts) -> Any:
    """The backend ``RunConfig.devices`` names (``kind`` and ``indices`` of its device spec)."""
    if kind == "cpu":
        from roundpipe.backends.cpu import CpuBackend

        return CpuBackend(runtime, num_devices=len(indices))
    if kind == "cuda":
        from roundpipe.backends.cuda import CudaBackend

        return CudaBackend(runtime, indices)
    from roundpipe.backends.fake import FakeBackend, FakeCostModel

    return FakeBackend(FakeCostModel(costs), execute=runtime.run)


def estimated_costs(host: HostModel, names: list[str]) -> LayerCosts:
    """Before anything was measured: forward time proportional to parameters (plus a floor so
    parameter-free layers are not free), backward twice the forward."""
    fwd = [1e-6 * n + 1e-3 for n in host.layer_numel()]
    return LayerCosts(tuple(fwd), tuple(2 * f for f in fwd), host.param_bytes(), tuple(names))
