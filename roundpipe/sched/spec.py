"""What the task graph is told about the model and the run, apart from the plan.

Why a module of its own: callers (the facade, the simulator, the benchmarks, the CLI) describe a
model once, as bytes per layer and the units that own its parameters, and choose the graph's knobs;
the graph builder only reads these values. They are frozen and validate on construction, and
they must never refer to tensors or modules.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler needs to know about the model's parameters, per layer.

    ``param_bytes``: bytes a stage must upload for the layer (0: nothing to upload).
    ``owners``: the trainable units whose parameters the layer reads (its own index when it has
    trainable parameters, plus the owner of any parameter it shares with a shallower layer).
    Layers with frozen parameters only have no owners: they are uploaded but never copied back.
    ``act_bytes``: bytes of one stage-boundary activation of one microbatch (for cost models).
    ``grad_bytes``: bytes of the layer's gradients a backward slot copies down (its trainable
    parameters only: a LoRA layer's adapters, not its frozen base); empty means every parameter
    of a layer with owners is trainable (``param_bytes`` for it, 0 for the others).
    """

    param_bytes: tuple[int, ...]
    owners: tuple[tuple[int, ...], ...]
    act_bytes: int = 0
    grad_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.param_bytes) != len(self.owners):
            raise ValueError(
                f"ModelSpec: {len(self.param_bytes)} param_bytes entries but {len(self.owners)} owners entries"
            )
        if self.grad_bytes and len(self.grad_bytes) != len(self.owners):
            raise ValueError(
                f"ModelSpec: {len(self.grad_bytes)} grad_bytes entries but {len(self.owners)} owners entries"
            )
        for layer, owners in enumerate(self.owners):
            for unit in owners:
                if not 0 <= unit < len(self.owners):
                    raise ValueError(f"ModelSpec: layer {layer} names unit {unit}, which is not a layer")

    @property
    def num_layers(self) -> int:
        return len(self.owners)

    def layer_grad_bytes(self, layer: int) -> int:
        """Bytes of ``layer``'s gradients copied down per backward slot (``grad_bytes``)."""
        if self.grad_bytes:
            return self.grad_bytes[layer]
        return self.param_bytes[layer] if self.owners[layer] else 0

    @property
    def units(self) -> tuple[int, ...]:
        """Trainable units, shallow first."""
        return tuple(sorted({u for owners in self.owners for u in owners}))

    @classmethod
    def uniform(cls, num_layers: int, *, param_bytes: int = 0, act_bytes: int = 0) -> ModelSpec:
        """Every layer trainable and owning its parameters (nothing shared)."""
        return cls(
            param_bytes=(param_bytes,) * num_layers,
            owners=tuple((layer,) for layer in range(num_layers)),
            act_bytes=act_bytes,
        )


@dataclass(frozen=True)
class ScheduleOptions:
    """Knobs of the task graph that do not change the plan."""

    async_optimizer: bool = True
    round_size: int | None = None
    chunk_bytes: int | None = None  # split a layer's upload into parts of at most this size
    grad_norm_barrier: bool = False  # a global pass over all gradients before any step (clipping)
    sync_steps: int = 0  # async warm-up: the first steps of an async run are synchronous
    # Steps (and grad-norm barriers) run in one order, deepest unit first, on every process: they
    # issue collectives, which gloo matches by order (roundpipe/optim/distributed.py).
    ordered_steps: bool = False
    # Async staleness remedy: these units read the weights of their iteration's own step
    # (staleness 0, the sync rules) while the rest read the step before. Every layer's owners are
    # all fresh or all not (`fresh_units_of`), so one upload reads one version.
    fresh_units: frozenset[int] = frozenset()
    # A backward run's activation and gradient uploads start while the device's previous
    # microbatch or run still computes (one microbatch ahead), or, when False, once it is done:
    # for microbatches so large that one more activation on the device does not fit (the planner
    # chooses it, `planning.device_plan.plan_from`); each upload is then exposed.
    inputs_ahead: bool = True
    # Stages whose parameters a device uploads ahead of the one it computes: the uploads of its
    # run k wait for its run k - 1 - prefetch_stages to end. One hides an upload behind the stage
    # before; a run whose forward stages are link-bound and backward ones compute-bound leaves the
    # link idle in the backward, which further stages ahead fill (up to three, chosen by
    # `planning.link_refine.with_prefetch`), each one more stage of parameters on the device
    # (`plan.memory.predict_peak`'s ``prefetch``).
    prefetch_stages: int = 1
    # Microbatches a stage run's inputs are uploaded ahead of its computes: the input of its
    # microbatch m waits for the compute of microbatch m - flow_depth to end (its first ones for
    # the device's run two before). Each is one more activation on the device (`predict_peak`'s
    # ``act_in_flight``); deeper lets the host issue more computes before a stage's weights land.
    flow_depth: int = 2
    # One device: a run's uploads wait for the previous run's last ones to be issued, so the
    # device's copy stream takes runs in order (`sched.forward_run` says why). False is the
    # graph without that order, for `bench/upload_order.py`'s comparison.
    uploads_in_run_order: bool = True
    # Parameter upload parts a run has on the link at once: part i waits for part i - this to
    # complete (`sched.param_uploads` says why); None, the default until a GPU has measured it:
    # no limit (`assembly.UPLOAD_PARTS_AHEAD` sets it for a run).
    upload_parts_ahead: int | None = None
    # A backward stage's act_up brings every one of its layers' inputs, saved by the forward slots
    # (RunConfig.recompute_grain="layer_input"), not only the one entering it.
    layer_inputs: bool = False
    # With ``layer_inputs``, each of those layers' post-attention residual too, which the forward
    # slot computing the layer saves (`roundpipe.model.attention_residual`).
    layer_residuals: bool = False

    def __post_init__(self) -> None:
        if self.prefetch_stages < 1:
            raise ValueError(
                f"prefetch_stages must be >= 1 (stages uploaded ahead), not {self.prefetch_stages}"
            )
        if self.upload_parts_ahead is not None and self.upload_parts_ahead < 1:
            raise ValueError(
                f"upload_parts_ahead must be >= 1 or None (no limit), not {self.upload_parts_ahead}"
            )
        if self.flow_depth < 1:
            raise ValueError(f"flow_depth must be >= 1 (microbatches uploaded ahead), not {self.flow_depth}")

    def is_async(self, unit: int) -> bool:
        """Whether ``unit`` follows the asynchronous rules (staleness 1 after the warm-up)."""
        return self.async_optimizer and unit not in self.fresh_units


def fresh_units_of(
    owners: tuple[tuple[int, ...], ...] | list[list[int]], deepest_layers: int, at: Collection[int] = ()
) -> frozenset[int]:
    """The units that can read fresh weights when the deepest ``deepest_layers`` layers and those
    at the indices ``at`` should (`RunConfig.fresh_layers`, `RunConfig.fresh_at`):
    `fresh_units_at` of `fresh_layer_set`."""
    return fresh_units_at(owners, fresh_layer_set(len(owners), deepest_layers, at))


def fresh_layer_set(num_layers: int, deepest_layers: int, at: Collection[int] = ()) -> set[int]:
    """The layers asked to read fresh weights: the deepest ``deepest_layers`` and those at ``at``."""
    return {*range(max(0, num_layers - deepest_layers), num_layers), *at}


def fresh_units_at(
    owners: tuple[tuple[int, ...], ...] | list[list[int]], layers: Collection[int]
) -> frozenset[int]:
    """The units that can read fresh weights when ``layers`` should: those whose every layer is
    among them, less any unit sharing a layer with one that is not (a head tied to the embedding
    stays stale with it), until no layer mixes the two."""
    chosen = set(layers)
    layers_of: dict[int, list[int]] = {}
    for layer, layer_owners in enumerate(owners):
        for unit in layer_owners:
            layers_of.setdefault(unit, []).append(layer)
    fresh = {unit for unit, held in layers_of.items() if all(layer in chosen for layer in held)}
    changed = True
    while changed:
        changed = False
        for layer_owners in owners:
            if any(u in fresh for u in layer_owners) and not all(u in fresh for u in layer_owners):
                fresh.difference_update(layer_owners)
                changed = True
    return frozenset(fresh)
