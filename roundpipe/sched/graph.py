"""Turns a plan into tasks: one iteration's graph at a time, and one optimizer step's.

Why a builder with memory: the rules relate tasks of different iterations (iteration t+1's
uploads wait for P-copy of an earlier step, gradient downloads wait for the previous G-copy),
round-robin dispatch carries its starting device across iterations, and a device may hold at most
one prefetched stage. The builder keeps exactly that bookkeeping (per unit: a `UnitLedger`; per
device: its recent stage runs) and nothing else, so the engine can stay a plain executor.

What one iteration contains, per stage run (a slot of a round on a device):
  per layer (chunked when large)  param_up     <- rule 2, the run two before on the device
                                                  (completed: one stage prefetched); optionally
                                                  the part N before (completed: `param_uploads`)
  per microbatch                  act_up       <- the previous slot's act_down (critical path),
                                                  and compute two microbatches back (completed:
                                                  one microbatch ahead); on one device after the
                                                  previous run's last uploads (issued)
                                  compute      <- act_up, all param_up chunks, previous microbatch
                                  act_down     <- compute
  (the chains: `sched/forward_run.py`; a backward run splits compute into recompute and
   backward, the gradient into its own grad_up: `sched/backward_run.py`)
  once (fused / backward runs)    grad_down    <- last compute, the previous round's grad_down
                                                  of this stage, rule 4
then per unit a G-copy (rule 3, rule 5). An optimizer step adds per unit, shallow first, step and
P-copy (rules 1 and 5), after an optional global grad-norm barrier (clipping, fp16 overflow).

The builder never touches tensors: tasks carry indices, backends look up the data. It is the one
description of what runs: plan evaluation replays this very graph (`roundpipe.planning.replay_graph`
writes its tasks down as numbers; the compiled builder there is checked against it task for task).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roundpipe.errors import ScheduleError
from roundpipe.plan.dispatch import SlotRun, dispatch
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.memory import input_sender, residual_sender
from roundpipe.plan.partition import Plan
from roundpipe.sched import rules
from roundpipe.sched.backward_run import BackwardRunContext, backward_chains
from roundpipe.sched.forward_run import forward_chains
from roundpipe.sched.keys import GCopyKey, GradDownKey, GradNormKey, PCopyKey, StepKey
from roundpipe.sched.param_uploads import param_uploads
from roundpipe.sched.rules import UnitLedger
from roundpipe.sched.spec import ModelSpec, ScheduleOptions
from roundpipe.sched.stage_run import IterationInProgress, StageRun, last_uploads
from roundpipe.sched.task import (
    G_COPY,
    GRAD_DOWN,
    GRAD_NORM,
    HOST_OPTIMIZER_LANE,
    LANE_OF_KIND,
    P_COPY,
    STEP,
    Key,
    Task,
    device_lane,
)

FRESH_CHAIN_PRIORITY = 13
"""A fresh unit's G-copy, step and P-copy: above every other task of the optimizer lane (P-copies
12, the rest 10; `sched.task.PRIORITY`)."""
RUNS_KEPT = 4
"""Stage runs remembered per device: enough for `planning.link_refine.MAX_PREFETCH_STAGES`."""


@dataclass
class IterationGraph:
    """The tasks of one forward_backward call and the keys a caller waits on."""

    iteration: int
    step: int
    tasks: list[Task]
    loss_keys: list[Key]  # the fused stage's compute per microbatch, in microbatch order
    done_keys: list[Key] = field(default_factory=list)  # everything that ends the iteration


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
        fresh_base_version: int | None = None,
    ) -> None:
        """``first_iteration``/``first_step`` continue a run's numbering (after a resume or a
        recovery); ``base_version`` is the weight version already in the compute copy
        (``fresh_base_version`` that of the fresh units, which never defer a P-copy: the same
        unless a resume found the others' P-copy deferred)."""
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
        self._device_uploads: dict[int, list[Key]] = {}  # in run order: the device's last run's last uploads
        self._lanes: dict[int, dict[str, str]] = {}  # device -> lane kind -> lane name
        self._first_device = 0
        self._iterations_of_step: dict[int, list[int]] = {}
        self._last_step = first_step - 1
        self._last_ordered: Key | None = None  # with ordered steps: the step task scheduled last
        self._last_iteration = first_iteration - 1
        self.base_version = base_version
        self.fresh_base_version = base_version if fresh_base_version is None else fresh_base_version
        for layer, layer_owners in enumerate(spec.owners):
            if len({unit in options.fresh_units for unit in layer_owners}) > 1:
                raise ScheduleError(
                    f"layer {layer} is owned by fresh and stale units {list(layer_owners)}: one "
                    "upload reads one weight version (choose the fresh units with fresh_units_of)"
                )

    def meta(self) -> dict[str, object]:
        """What a trace needs to be checked and replayed without the model."""
        return {
            "owners": [list(o) for o in self.spec.owners],
            "async_optimizer": self.options.async_optimizer,
            "num_devices": self.num_devices,
            "plan": self.plan.to_dict(),
            "base_version": self.base_version,
            "sync_steps": self.options.sync_steps,
            "fresh_units": sorted(self.options.fresh_units),
            "fresh_base_version": self.fresh_base_version,
            "inputs_ahead": self.options.inputs_ahead,
            "prefetch_stages": self.options.prefetch_stages,
            "flow_depth": self.options.flow_depth,
            "uploads_in_run_order": self.options.uploads_in_run_order,
            "upload_parts_ahead": self.options.upload_parts_ahead,
            "layer_residuals": self.options.layer_residuals,
        }

    @property
    def next_iteration(self) -> int:
        """The number the next `forward_backward` graph will carry."""
        return self._last_iteration + 1

    def set_plan(self, plan: Plan) -> None:
        """Switch to a new plan for the following iterations (costs were re-profiled)."""
        if plan.num_layers != self.plan.num_layers:
            raise ScheduleError("a new plan must cover the same layers")
        self.plan = plan

    # ------------------------------------------------------------------ one iteration

    def forward_backward(self, iteration: int, step: int, num_microbatches: int) -> IterationGraph:
        """The tasks of one forward_backward call, in dependency order: per stage run its
        parameter uploads, then per microbatch act_up, compute, act_down, then its gradient
        download; after all runs the G-copies."""
        self._start_iteration(iteration, step)
        runs, self._first_device = dispatch(
            self.plan,
            num_microbatches,
            self.num_devices,
            iteration=iteration,
            first_device=self._first_device,
            round_size=self.options.round_size,
        )
        version = rules.weight_version(step, self.options.async_optimizer, self.options.sync_steps)
        built = IterationInProgress(iteration, step, version)
        in_order = self.num_devices == 1 and self.options.uploads_in_run_order
        versions = (self.base_version, self.fresh_base_version)
        for slot_run in runs:
            run = self._stage_run(slot_run, built)
            history = self._device_runs.get(run.device, [])
            param_keys = param_uploads(run, built, self.spec, self.options, self.ledgers, history, versions)
            after = self._device_uploads.get(run.device, [])
            if run.kind == SlotKind.BWD:
                last_compute = backward_chains(run, param_keys, built, self._backward_context(run, after))
            else:
                two_back = history[-2] if len(history) >= 2 else None
                down_bytes = self.spec.act_bytes if run.slot < self.plan.num_slots - 1 else 0
                heavier_before = run.kind == SlotKind.FUSED and self._waits_for_previous(run.slot)
                first_after = history[-1] if history and heavier_before else None  # `backward_run`
                chains = (
                    self.spec.act_bytes,
                    down_bytes,
                    two_back,
                    self.options.flow_depth,
                    after,
                    first_after,
                )
                last_compute = forward_chains(run, param_keys, built, *chains)
            self._remember_on_device(run.device, last_compute)
            if in_order:
                self._device_uploads[run.device] = last_uploads(run)
            self._grad_download(run, last_compute, built)
        done_keys: list[Key] = list(built.last_grad_down.values())
        done_keys += self._g_copies(built)
        return IterationGraph(iteration, step, built.tasks, built.loss_keys, done_keys)

    def _start_iteration(self, iteration: int, step: int) -> None:
        if iteration <= self._last_iteration:
            raise ScheduleError(f"iteration {iteration} was already built")
        if step <= self._last_step:
            raise ScheduleError(f"iteration {iteration} belongs to step {step}, which was already stepped")
        self._last_iteration = iteration
        self._iterations_of_step.setdefault(step, []).append(iteration)

    def _stage_run(self, slot_run: SlotRun, built: IterationInProgress) -> StageRun:
        device, slot = slot_run.device, slot_run.slot
        lanes = self._lanes.get(device)
        if lanes is None:
            lanes = self._lanes[device] = {
                kind: device_lane(device, lane) for kind, lane in LANE_OF_KIND.items()
            }
        return StageRun(
            built.iteration,
            built.step,
            slot_run.round,
            slot.index,
            slot.name,
            slot.kind,
            slot.layers,
            device,
            lanes,
            slot_run.microbatches,
        )

    def _backward_context(self, run: StageRun, uploads_after: list[Key]) -> BackwardRunContext:
        """What a backward run's chains wait for outside the run (see `backward_run`)."""
        start = run.layers.stop - 1 if self.options.layer_inputs else run.layers.start  # deepest saved last
        saved_by = read_by = None
        stages = self.plan.fwd_stages  # forward slot i holds fwd_stages[i]
        if start > 0:
            # With residuals the slot computing it saves its residual last; else its input's sender.
            sender = residual_sender if self.options.layer_residuals else input_sender
            saved_by = sender(stages, start)
            assert saved_by is not None, f"layer {start} is past the forward stages"
            if not self.options.layer_residuals:
                read_by = saved_by + 1 if stages[saved_by].stop == start else None
        history, runs_back = self._device_runs.get(run.device, ()), 2 if self.options.inputs_ahead else 1
        return BackwardRunContext(
            act_bytes=self.spec.act_bytes,
            down_bytes=self.spec.act_bytes if run.slot < self.plan.num_slots - 1 else 0,
            saved_by=saved_by,
            read_by=read_by,
            flow_run=history[-runs_back] if len(history) >= runs_back else None,
            previous_run_done=history[-1] if history and self.num_devices == 1 else None,
            previous_run_sync=self._waits_for_previous(run.slot),
            flow_depth=self.options.flow_depth if self.options.inputs_ahead else 1,
            inputs=len(run.layers) * (1 + self.options.layer_residuals) if self.options.layer_inputs else 1,
            uploads_after=tuple(uploads_after),
        )

    def _waits_for_previous(self, slot: int) -> bool:
        """Whether a one-device fused or backward run of ``slot`` starts only once the previous
        run's last compute has completed: where that run uploads more bytes than the stage this one
        uploads farthest ahead (``prefetch_stages`` on, cyclically). `backward_run` says why."""
        if self.num_devices != 1:
            return False
        slots = self.plan.slots

        def uploaded(index: int) -> int:
            return sum(self.spec.param_bytes[layer] for layer in slots[index % len(slots)].layers)

        return uploaded(slot - 1) > uploaded(slot + self.options.prefetch_stages)

    def _remember_on_device(self, device: int, last_compute: Key) -> None:
        """Keep a device's latest runs: a run's uploads wait for the one ``prefetch_stages`` + 1
        before, its first activation for the one two before. At least `RUNS_KEPT`, so that
        options switched to deeper prefetch between iterations find the run to wait for."""
        history = self._device_runs.setdefault(device, [])
        history.append(last_compute)
        if len(history) > max(RUNS_KEPT, self.options.prefetch_stages + 1):
            del history[0]

    def _grad_download(self, run: StageRun, last_compute: Key, built: IterationInProgress) -> None:
        """Once per fused or backward run with trainable layers: after its last compute, the
        previous round's download of the same slot, or (first of the iteration) rule 4."""
        if run.kind == SlotKind.FWD:
            return
        spec, ledgers = self.spec, self.ledgers
        units = sorted({unit for layer in run.layers for unit in spec.owners[layer]})
        if not units:
            return
        key = GradDownKey(run.iteration, run.round, run.slot)
        deps: list[Key] = [last_compute]
        previous = built.last_grad_down.get(run.slot)
        if previous is not None:
            deps.append(previous)
        else:
            for unit in units:
                deps += rules.gradient_write_order(ledgers[unit])
        trainable_bytes = sum(spec.layer_grad_bytes(layer) for layer in run.layers)
        built.tasks.append(run.task(key, GRAD_DOWN, deps, nbytes=trainable_bytes))
        built.last_grad_down[run.slot] = key
        for unit in units:
            ledgers[unit].grad_downloads.setdefault(run.iteration, []).append(key)
            built.g_copy_units.add(unit)

    def _g_copies(self, built: IterationInProgress) -> list[Key]:
        """Per unit with gradients, shallow first: G-copy after every download of the iteration
        (rule 3) and the previous step (rule 5)."""
        keys: list[Key] = []
        for unit in sorted(built.g_copy_units):
            ledger = self.ledgers[unit]
            key = GCopyKey(built.iteration, unit)
            deps = rules.complete_gradients(ledger, built.iteration)
            deps += rules.g_copy_after_step(ledger, built.step, sync=not self._deferred(built.step - 1, unit))
            built.tasks.append(self._unit_task(key, G_COPY, unit, deps, built.step, built.iteration))
            ledger.last_g_copy = key
            keys.append(key)
        return keys

    # ------------------------------------------------------------------ one optimizer step

    def optimizer_step(self, step: int) -> list[Task]:
        """Tasks of optimizer step ``step``: [grad norm], then per unit, shallow first, in async
        mode the P-copy owed by the previous step followed by this step, in sync mode (and the
        async warm-up) this step followed by its P-copy."""
        if step <= self._last_step:
            raise ScheduleError(f"step {step} was already scheduled")
        self._last_step = step
        iterations = self._iterations_of_step.pop(step, [])
        tasks: list[Task] = []
        norm_key: Key | None = None
        if self.options.grad_norm_barrier:
            norm_key = GradNormKey(step)
            deps: list[Key] = [GCopyKey(t, u) for t in iterations for u in self.ledgers]
            deps += self._chained()
            tasks.append(Task(norm_key, GRAD_NORM, HOST_OPTIMIZER_LANE, deps=deps, step=step))
        units = list(self.ledgers)
        for index, (unit, ledger) in enumerate(self.ledgers.items()):
            if self._deferred(step - 1, unit) and step > self.base_version:
                tasks.append(self._p_copy(unit, ledger, step - 1))
            # Every trainable unit lies in a fused or backward stage: each iteration G-copies it.
            g_copies: list[Key] = [GCopyKey(t, unit) for t in iterations]
            deps = rules.step_after_copies(ledger, step, g_copies)
            if norm_key is not None:
                deps.append(norm_key)
            if self.options.ordered_steps:  # deepest first: its gradient lands first
                deps += [StepKey(step, units[index + 1])] if index + 1 < len(units) else self._chained()
            key = StepKey(step, unit)
            tasks.append(self._unit_task(key, STEP, unit, deps, step))
            ledger.step[step] = key
            ledger.step.pop(step - 2, None)
            if not self._deferred(step, unit):
                tasks.append(self._p_copy(unit, ledger, step))
        if self.options.ordered_steps:
            self._last_ordered = StepKey(step, units[0])
        return tasks

    def _unit_task(
        self, key: Key, kind: str, unit: int, deps: list[Key], step: int, iteration: int = -1
    ) -> Task:
        """One unit's G-copy, step or P-copy on the optimizer lane. A fresh unit's, in an async
        run, come before anything else there: the next iteration's forward waits for them while
        the stale units' work can wait (rule 5 allows it); every other unit's run at their kind's
        priority."""
        fresh = self.options.async_optimizer and unit in self.options.fresh_units
        return Task(
            key,
            kind,
            HOST_OPTIMIZER_LANE,
            deps=deps,
            layers=range(unit, unit + 1),
            iteration=iteration,
            step=step,
            priority=FRESH_CHAIN_PRIORITY if fresh else None,
        )

    def _deferred(self, step: int, unit: int) -> bool:
        return rules.deferred_p_copy(step, self.options.is_async(unit), self.options.sync_steps)

    def _chained(self) -> list[Key]:
        """With ordered steps: the last step task of the previous step, which comes before."""
        last = self._last_ordered if self.options.ordered_steps else None
        return [last] if last is not None else []

    def _p_copy(self, unit: int, ledger: UnitLedger, step: int) -> Task:
        key = PCopyKey(step, unit)
        deps = rules.weight_integrity(ledger, step)
        if step in ledger.step:
            deps.append(ledger.step[step])
        ledger.p_copy[step + 1] = key
        ledger.p_copy.pop(step - 1, None)
        return self._unit_task(key, P_COPY, unit, deps, step)


__all__ = ["GraphBuilder", "IterationGraph", "ModelSpec", "ScheduleOptions"]
