"""Turns a plan into tasks: one iteration's graph at a time, and one optimizer step's.

Why a builder with memory: the rules relate tasks of different iterations (iteration t+1's
uploads wait for P-copy of an earlier step, gradient downloads wait for the previous G-copy),
round-robin dispatch carries its starting device across iterations, and a device may hold at most
one prefetched stage. The builder keeps exactly that bookkeeping (per unit: a `UnitLedger`; per
device: its recent stage runs) and nothing else, so the engine can stay a plain executor.

What one iteration contains, per stage run (a slot of a round on a device):
  per layer (chunked when large)  param_up     <- rule 2, and the run two before on the device
  per microbatch                  act_up       <- the previous slot's act_down (critical path),
                                                  and compute two microbatches back (one ahead)
                                  compute      <- act_up, all param_up chunks, previous microbatch
                                  act_down     <- compute
  once (fused / backward runs)    grad_down    <- last compute, the previous round's grad_down
                                                  of this stage, rule 4
then per unit a G-copy (rule 3, rule 5). An optimizer step adds per unit, shallow first, step and
P-copy (rules 1 and 5), after an optional global grad-norm barrier (clipping, fp16 overflow).

The builder never touches tensors: tasks carry indices, backends look up the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roundpipe.errors import ScheduleError
from roundpipe.plan.dispatch import SlotRun, dispatch
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.partition import Plan
from roundpipe.sched import rules
from roundpipe.sched.keys import (
    ActDownKey,
    ActUpKey,
    ComputeKey,
    GCopyKey,
    GradDownKey,
    GradNormKey,
    ParamUpKey,
    PCopyKey,
    StepKey,
)
from roundpipe.sched.rules import UnitLedger
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    DEVICE_LANES,
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    HOST_OPTIMIZER_LANE,
    P_COPY,
    PARAM_UP,
    STEP,
    Key,
    Task,
    device_lane,
)


@dataclass(frozen=True)
class ModelSpec:
    """What the scheduler needs to know about the model's parameters, per layer.

    ``param_bytes``: bytes a stage must upload for the layer (0: nothing to upload).
    ``owners``: the trainable units whose parameters the layer reads (its own index when it has
    trainable parameters, plus the owner of any parameter it shares with a shallower layer).
    Layers with frozen parameters only have no owners: they are uploaded but never copied back.
    ``act_bytes``: bytes of one stage-boundary activation of one microbatch (for cost models).
    """

    param_bytes: tuple[int, ...]
    owners: tuple[tuple[int, ...], ...]
    act_bytes: int = 0

    def __post_init__(self) -> None:
        if len(self.param_bytes) != len(self.owners):
            raise ValueError(
                f"ModelSpec: {len(self.param_bytes)} param_bytes entries but {len(self.owners)} owners entries"
            )
        for layer, owners in enumerate(self.owners):
            for unit in owners:
                if not 0 <= unit < len(self.owners):
                    raise ValueError(f"ModelSpec: layer {layer} names unit {unit}, which is not a layer")

    @property
    def num_layers(self) -> int:
        return len(self.owners)

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


@dataclass
class IterationGraph:
    """The tasks of one forward_backward call and the keys a caller waits on."""

    iteration: int
    step: int
    tasks: list[Task]
    runs: list[SlotRun]
    loss_keys: list[Key]  # the fused stage's compute per microbatch, in microbatch order
    done_keys: list[Key] = field(default_factory=list)  # everything that ends the iteration


@dataclass(frozen=True)
class ScheduleOptions:
    """Knobs of the task graph that do not change the plan."""

    async_optimizer: bool = True
    round_size: int | None = None
    chunk_bytes: int | None = None  # split a layer's upload into parts of at most this size
    grad_norm_barrier: bool = False  # a global pass over all gradients before any step (clipping)


class GraphBuilder:
    """Builds task graphs for successive iterations and optimizer steps of one run."""

    def __init__(
        self,
        plan: Plan,
        spec: ModelSpec,
        num_devices: int,
        options: ScheduleOptions,
        *,
        first_iteration: int = 0,
        first_step: int = 0,
        base_version: int = 0,
    ) -> None:
        """``first_iteration``/``first_step`` continue a run's numbering (after a resume or a
        recovery); ``base_version`` is the weight version already in the compute copy."""
        if spec.num_layers != plan.num_layers:
            raise ScheduleError(
                f"the plan covers {plan.num_layers} layers but the model has {spec.num_layers}"
            )
        self.plan = plan
        self.spec = spec
        self.num_devices = num_devices
        self.options = options
        self.ledgers: dict[int, UnitLedger] = {u: UnitLedger() for u in spec.units}
        self._device_runs: dict[int, list[Key]] = {}
        self._lanes: dict[int, dict[str, str]] = {}  # device -> lane kind -> lane name
        self._first_device = 0
        self._iterations_of_step: dict[int, list[int]] = {}
        self._last_step = first_step - 1
        self._last_iteration = first_iteration - 1
        self.base_version = base_version

    def meta(self) -> dict[str, object]:
        """What a trace needs to be checked and replayed without the model."""
        return {
            "owners": [list(o) for o in self.spec.owners],
            "async_optimizer": self.options.async_optimizer,
            "num_devices": self.num_devices,
            "plan": self.plan.to_dict(),
            "base_version": self.base_version,
        }

    def set_plan(self, plan: Plan) -> None:
        """Switch to a new plan for the following iterations (costs were re-profiled)."""
        if plan.num_layers != self.plan.num_layers:
            raise ScheduleError("a new plan must cover the same layers")
        self.plan = plan

    # ------------------------------------------------------------------ one iteration

    def forward_backward(self, iteration: int, step: int, num_microbatches: int) -> IterationGraph:
        if iteration <= self._last_iteration:
            raise ScheduleError(f"iteration {iteration} was already built")
        if step <= self._last_step:
            raise ScheduleError(f"iteration {iteration} belongs to step {step}, which was already stepped")
        self._last_iteration = iteration
        self._iterations_of_step.setdefault(step, []).append(iteration)
        version = rules.weight_version(step, self.options.async_optimizer)
        runs, self._first_device = dispatch(
            self.plan,
            num_microbatches,
            self.num_devices,
            iteration=iteration,
            first_device=self._first_device,
            round_size=self.options.round_size,
        )
        spec, ledgers = self.spec, self.ledgers
        tasks: list[Task] = []
        loss_keys: list[Key] = []
        num_slots = self.plan.num_slots
        last_grad_down: dict[int, Key] = {}  # slot -> grad_down of the previous round
        g_copy_needed: set[int] = set()
        act_bytes = spec.act_bytes

        lanes = self._lanes
        for run in runs:
            slot = run.slot
            d = run.device
            t = iteration
            r = run.round
            si = slot.index
            layers = slot.layers
            mbs = run.microbatches
            # Hoisted out of the per-task loops below: they are the same for every task of the run.
            name, kind = slot.name, slot.kind
            lane = lanes.get(d)
            if lane is None:
                lane = lanes[d] = {x: device_lane(d, x) for x in DEVICE_LANES}
            history = self._device_runs.setdefault(d, [])
            prefetch_dep = [history[-2]] if len(history) >= 2 else []

            # Parameter uploads: one task per layer (or per chunk of a large layer).
            param_keys: list[Key] = []
            for layer in layers:
                nbytes = spec.param_bytes[layer]
                if nbytes <= 0 and not spec.owners[layer]:
                    continue  # nothing to upload and no weight version to wait for
                chunk = self.options.chunk_bytes
                parts = 1 if not chunk else max(1, -(-nbytes // chunk))
                deps: list[Key] = list(prefetch_dep)
                for unit in spec.owners[layer]:
                    deps += rules.no_torn_weights(ledgers[unit], version, self.base_version)
                for part in range(parts):
                    key: Key = ParamUpKey(t, r, si, layer, part)
                    tasks.append(
                        Task(
                            key,
                            PARAM_UP,
                            lane["param_up"],
                            deps=deps,
                            device=d,
                            layers=range(layer, layer + 1),
                            stage=name,
                            stage_kind=kind,
                            slot=si,
                            iteration=t,
                            round=r,
                            step=version,
                            part=part,
                            num_parts=parts,
                            nbytes=nbytes // parts + (1 if part < nbytes % parts else 0),
                        )
                    )
                    param_keys.append(key)
                    for unit in spec.owners[layer]:
                        ledgers[unit].readers.setdefault(version, []).append(key)

            # Per microbatch: activation up, compute, activation down.
            last_compute: Key | None = None
            for j, mb in enumerate(mbs):
                up_key = ActUpKey(t, si, mb)
                up_deps: list[Key] = []
                if si > 0:
                    up_deps.append(ActDownKey(t, si - 1, mb))
                if j >= 2:
                    up_deps.append(ComputeKey(t, si, mbs[j - 2]))
                tasks.append(
                    Task(
                        up_key,
                        ACT_UP,
                        lane["act_up"],
                        deps=up_deps,
                        device=d,
                        layers=layers,
                        stage=name,
                        stage_kind=kind,
                        slot=si,
                        microbatch=mb,
                        iteration=t,
                        round=r,
                        step=step,
                        nbytes=act_bytes * (2 if kind == SlotKind.BWD else 1),
                    )
                )
                compute_key = ComputeKey(t, si, mb)
                compute_deps = [up_key, *param_keys]
                if last_compute is not None:
                    compute_deps.append(last_compute)
                tasks.append(
                    Task(
                        compute_key,
                        COMPUTE,
                        lane["compute"],
                        deps=compute_deps,
                        device=d,
                        layers=layers,
                        stage=name,
                        stage_kind=kind,
                        slot=si,
                        microbatch=mb,
                        iteration=t,
                        round=r,
                        step=step,
                        part=j,
                        num_parts=len(mbs),
                    )
                )
                if kind == SlotKind.FUSED:
                    loss_keys.append(compute_key)
                tasks.append(
                    Task(
                        ActDownKey(t, si, mb),
                        ACT_DOWN,
                        lane["act_down"],
                        deps=[compute_key],
                        device=d,
                        layers=layers,
                        stage=name,
                        stage_kind=kind,
                        slot=si,
                        microbatch=mb,
                        iteration=t,
                        round=r,
                        step=step,
                        nbytes=act_bytes if si < num_slots - 1 else 0,
                    )
                )
                last_compute = compute_key
            assert last_compute is not None
            history.append(last_compute)
            if len(history) > 2:
                del history[0]

            # Gradient download: once per fused/backward run that has trainable layers.
            if kind == SlotKind.FWD:
                continue
            units = sorted({u for layer in layers for u in spec.owners[layer]})
            if not units:
                continue
            down_key = GradDownKey(t, r, si)
            down_deps: list[Key] = [last_compute]
            if si in last_grad_down:
                down_deps.append(last_grad_down[si])
            else:
                for unit in units:
                    down_deps += rules.gradient_write_order(ledgers[unit])
            trainable_bytes = sum(spec.param_bytes[layer] for layer in layers if spec.owners[layer])
            tasks.append(
                Task(
                    down_key,
                    GRAD_DOWN,
                    lane["grad_down"],
                    deps=down_deps,
                    device=d,
                    layers=layers,
                    stage=name,
                    stage_kind=kind,
                    slot=si,
                    iteration=t,
                    round=r,
                    step=step,
                    nbytes=trainable_bytes,
                )
            )
            last_grad_down[si] = down_key
            for unit in units:
                ledgers[unit].grad_downloads.setdefault(t, []).append(down_key)
                g_copy_needed.add(unit)

        # G-copies, shallow units first.
        done_keys: list[Key] = list(last_grad_down.values())
        for unit in sorted(g_copy_needed):
            ledger = ledgers[unit]
            key = GCopyKey(iteration, unit)
            deps = rules.complete_gradients(ledger, iteration)
            deps += rules.g_copy_after_step(ledger, step, sync=not self.options.async_optimizer)
            tasks.append(
                Task(
                    key,
                    G_COPY,
                    HOST_OPTIMIZER_LANE,
                    deps=deps,
                    layers=range(unit, unit + 1),
                    iteration=iteration,
                    step=step,
                )
            )
            ledger.last_g_copy = key
            done_keys.append(key)
        return IterationGraph(iteration, step, tasks, runs, loss_keys, done_keys)

    # ------------------------------------------------------------------ one optimizer step

    def optimizer_step(self, step: int) -> list[Task]:
        """Tasks of optimizer step ``step``: [grad norm], then per unit, shallow first, in async
        mode the P-copy owed by the previous step followed by this step, in sync mode this step
        followed by its P-copy."""
        if step <= self._last_step:
            raise ScheduleError(f"step {step} was already scheduled")
        self._last_step = step
        iterations = self._iterations_of_step.pop(step, [])
        tasks: list[Task] = []
        norm_key: Key | None = None
        if self.options.grad_norm_barrier:
            norm_key = GradNormKey(step)
            deps: list[Key] = [GCopyKey(t, u) for t in iterations for u in self.ledgers]
            tasks.append(Task(norm_key, GRAD_NORM, HOST_OPTIMIZER_LANE, deps=deps, step=step))
        for unit, ledger in self.ledgers.items():
            if self.options.async_optimizer and step > self.base_version:
                tasks.append(self._p_copy(unit, ledger, step - 1))
            # Every trainable unit lies in a fused or backward stage: each iteration G-copies it.
            g_copies: list[Key] = [GCopyKey(t, unit) for t in iterations]
            deps = rules.step_after_copies(ledger, step, g_copies)
            if norm_key is not None:
                deps.append(norm_key)
            key = StepKey(step, unit)
            tasks.append(
                Task(key, STEP, HOST_OPTIMIZER_LANE, deps=deps, layers=range(unit, unit + 1), step=step)
            )
            ledger.step[step] = key
            ledger.step.pop(step - 2, None)
            if not self.options.async_optimizer:
                tasks.append(self._p_copy(unit, ledger, step))
        return tasks

    def _p_copy(self, unit: int, ledger: UnitLedger, step: int) -> Task:
        key = PCopyKey(step, unit)
        deps = rules.weight_integrity(ledger, step)
        if step in ledger.step:
            deps.append(ledger.step[step])
        ledger.p_copy[step + 1] = key
        ledger.p_copy.pop(step - 1, None)
        return Task(key, P_COPY, HOST_OPTIMIZER_LANE, deps=deps, layers=range(unit, unit + 1), step=step)
