"""One stage run while its iteration's graph is built: the fields its tasks share.

Why apart from the builder: every device task of a run (a slot of a round on a device) repeats the
same dozen fields, so `StageRun.task` fills them once and the builder only says what differs (key,
kind, dependencies, microbatch, bytes). `IterationInProgress` is what the runs of one iteration
hand to each other. Both live only while `GraphBuilder.forward_backward` runs and must never
outlive it or hold anything but keys and tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.keys import ActDownKey, ActUpKey, GradUpKey
from roundpipe.sched.kinds import TaskKind
from roundpipe.sched.task import Key, Task


@dataclass
class IterationInProgress:
    """What the stage runs of one iteration hand to each other while its graph is built."""

    iteration: int
    step: int  # the optimizer step the iteration belongs to
    version: int  # the weight version its parameter uploads read
    tasks: list[Task] = field(default_factory=list)
    loss_keys: list[Key] = field(default_factory=list)
    last_act_down: dict[int, ActDownKey] = field(default_factory=dict)  # microbatch -> latest slot's
    last_grad_down: dict[int, Key] = field(default_factory=dict)  # slot -> previous round's
    g_copy_units: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class StageRun:
    """One slot of a round on one device: the fields every device task of the run shares."""

    iteration: int
    step: int
    round: int
    slot: int
    name: str
    kind: SlotKind
    layers: range
    device: int
    lanes: dict[str, str]  # lane kind -> the device's lane name
    microbatches: range

    def task(
        self,
        key: Key,
        kind: TaskKind,
        deps: list[Key],
        *,
        layers: range | None = None,
        step: int | None = None,
        microbatch: int = -1,
        part: int = 0,
        num_parts: int = 1,
        nbytes: int = 0,
        sync_deps: list[Key] | tuple[()] = (),
    ) -> Task:
        """A task of this run on the lane of its kind; ``layers`` and ``step`` default to the run's."""
        return Task(
            key,
            kind,
            self.lanes[kind],
            deps=deps,
            device=self.device,
            layers=self.layers if layers is None else layers,
            stage=self.name,
            stage_kind=self.kind,
            slot=self.slot,
            microbatch=microbatch,
            iteration=self.iteration,
            round=self.round,
            step=self.step if step is None else step,
            part=part,
            num_parts=num_parts,
            nbytes=nbytes,
            sync_deps=sync_deps,
        )


def previous_act_down(last_down: dict[int, ActDownKey], run: StageRun, microbatch: int) -> Key:
    """The act_down of the slot before ``run``'s for ``microbatch`` (the key object already built
    when dispatch order emitted that slot first, which it does)."""
    key = last_down.get(microbatch)
    if key is None or key.slot != run.slot - 1:
        key = ActDownKey(run.iteration, run.slot - 1, microbatch)
    return key


def last_uploads(run: StageRun) -> list[Key]:
    """The uploads of ``run``'s last microbatch (its input; a backward run's gradient too): the
    next run on the device issues its own after them (`forward_run` says why)."""
    t, slot, mb = run.iteration, run.slot, run.microbatches[-1]
    keys: list[Key] = [ActUpKey(t, slot, mb)]
    if run.kind == SlotKind.BWD:
        keys.append(GradUpKey(t, slot, mb))
    return keys
