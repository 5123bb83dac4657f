"""The task: the one unit of work every part of roundpipe speaks about.

A parameter upload, an activation transfer, a compute stage over one microbatch, a gradient
download, a G-copy, an optimizer step and a P-copy are all the same object: a `Task` with a kind,
a lane, a priority and dependencies declared by key. The engine orders them, backends run them,
the trace records them and the rule checker reads them. A task is plain data (``__slots__``, no
asyncio objects, no tensors) so that a graph of 10^5 tasks is cheap to build, run and save.

A task must never hold a reference to a tensor or a module: backends look up what to do from the
task's fields, so a task can be printed, saved as JSON and replayed on the fake backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from roundpipe.sched.keys import Key, key_from_json
from roundpipe.sched.kinds import SlotKind, TaskKind, TaskState

# The kinds under their short names, as the graph builder, backends and views spell them.
PARAM_UP = TaskKind.PARAM_UP
ACT_UP = TaskKind.ACT_UP
GRAD_UP = TaskKind.GRAD_UP
RECOMPUTE = TaskKind.RECOMPUTE
COMPUTE = TaskKind.COMPUTE
ACT_DOWN = TaskKind.ACT_DOWN
GRAD_DOWN = TaskKind.GRAD_DOWN
G_COPY = TaskKind.G_COPY
GRAD_NORM = TaskKind.GRAD_NORM
STEP = TaskKind.STEP
P_COPY = TaskKind.P_COPY

DEVICE_LANES = (COMPUTE, ACT_UP, ACT_DOWN, PARAM_UP, GRAD_DOWN)
"""The lanes of every device, named after the kind of task they run, in display order."""
LANE_OF_KIND: dict[str, str] = {**{kind: kind for kind in DEVICE_LANES}, RECOMPUTE: COMPUTE, GRAD_UP: ACT_UP}
"""The device lane each device task kind runs on: two kinds share a lane with another."""
COMPUTE_KINDS = frozenset((COMPUTE, RECOMPUTE))
"""The kinds that run on a compute lane: what keeps a device busy."""
HOST_OPTIMIZER_LANE = "host.optimizer"

# Higher runs first among ready tasks that share a resource: activations are on the critical path,
# parameters are needed one stage ahead, gradients can wait until a link is idle. On the optimizer
# lane the P-copy goes first: the next iteration's uploads wait for it (rule 2), while a step in
# async mode is first read two iterations later (a deferred P-copy that waited behind the steps
# of the shallower units held the next iteration's uploads for them).
PRIORITY: dict[str, int] = {
    ACT_UP: 30,
    GRAD_UP: 30,
    ACT_DOWN: 30,
    COMPUTE: 20,
    RECOMPUTE: 20,
    PARAM_UP: 20,
    GRAD_DOWN: 10,
    G_COPY: 10,
    GRAD_NORM: 10,
    STEP: 10,
    P_COPY: 12,
}
_NEW = TaskState.NEW  # a module global: enum class attributes are slow to read per task
_KIND_BY_NAME: dict[str, str] = {kind.value: kind for kind in TaskKind}
_STAGE_KIND_BY_NAME: dict[str, str] = {kind.value: kind for kind in SlotKind}


def device_lane(device: int, lane: str) -> str:
    """Name of a device lane, e.g. ``device_lane(2, "compute") == "d2.compute"``."""
    return f"d{device}.{lane}"


class Task:
    """One unit of work on one lane.

    Declared fields (set by whoever builds the graph):
      key (a key type of `roundpipe.sched.keys`, e.g. ``ComputeKey(iteration, slot, microbatch)``,
      or any hashable tuple), kind (`TaskKind`), lane, priority, deps (keys), device (int, or -1
      for the host), layers (range), stage (slot name such as ``"F1"``, ``"FB"``, ``"B3"``, or
      ``""``), stage_kind (`SlotKind`, or ``""`` outside a stage), slot (index in the dispatch
      sequence), microbatch (-1 when not per microbatch), iteration (forward_backward call),
      round (of the iteration's dispatch), step (for parameter uploads: the weight version read;
      for step/P-copy/G-copy/grad-norm: the optimizer step; for other device tasks: the step the
      iteration belongs to), part/num_parts (a chunk of a large upload, or for compute tasks a
      microbatch's position within its stage run), nbytes (bytes moved, when known).

    Run-time fields (set by the engine): seq, unmet, dependents, submit/ready/start/end times (ms),
    state (`TaskState`), error.
    """

    __slots__ = (
        "dependents",
        "deps",
        "device",
        "end_t",
        "error",
        "issue_dependents",
        "issue_t",
        "iteration",
        "key",
        "kind",
        "lane",
        "layers",
        "microbatch",
        "nbytes",
        "num_parts",
        "part",
        "priority",
        "ready_t",
        "round",
        "seq",
        "slot",
        "stage",
        "stage_kind",
        "start_t",
        "state",
        "step",
        "submit_t",
        "sync_deps",
        "unmet",
    )

    def __init__(
        self,
        key: Key,
        kind: str,
        lane: str,
        *,
        deps: Iterable[Key] = (),
        priority: int | None = None,
        device: int = -1,
        layers: range = range(0),
        stage: str = "",
        stage_kind: str = "",
        slot: int = -1,
        microbatch: int = -1,
        iteration: int = -1,
        round: int = -1,
        step: int = -1,
        part: int = 0,
        num_parts: int = 1,
        nbytes: int = 0,
        sync_deps: Iterable[Key] = (),
    ) -> None:
        self.key = key
        self.kind = kind
        self.lane = lane
        self.deps: tuple[Key, ...] = tuple(deps)
        # Dependencies that must have *completed*, not merely been issued, even where the backend
        # issues device work ahead (flow control: one stage prefetched, one microbatch ahead).
        self.sync_deps: tuple[Key, ...] = tuple(sync_deps)
        self.priority = PRIORITY.get(kind, 0) if priority is None else priority
        self.device = device
        self.layers = layers
        self.stage = stage
        self.stage_kind = stage_kind
        self.slot = slot
        self.microbatch = microbatch
        self.iteration = iteration
        self.round = round
        self.step = step
        self.part = part
        self.num_parts = num_parts
        self.nbytes = nbytes
        self.seq = -1
        self.unmet = 0
        self.dependents: list[Task] = []  # released when this task is done
        self.issue_dependents: list[Task] = []  # device tasks released when this task is issued
        self.issue_t = -1.0
        self.submit_t = -1.0
        self.ready_t = -1.0
        self.start_t = -1.0
        self.end_t = -1.0
        self.state: TaskState = _NEW
        self.error: BaseException | None = None

    @property
    def duration(self) -> float:
        return self.end_t - self.start_t

    def describe(self) -> str:
        """A one-line, human-readable name: what, where, which layers/microbatch/iteration."""
        bits = [self.kind]
        if self.stage:
            bits.append(self.stage)
        if len(self.layers):
            first, last = self.layers.start, self.layers.stop - 1
            bits.append(f"layer {first}" if first == last else f"layers {first}-{last}")
        if self.num_parts > 1 and self.kind == PARAM_UP:
            bits.append(f"part {self.part + 1}/{self.num_parts}")
        if self.microbatch >= 0:
            bits.append(f"microbatch {self.microbatch}")
        if self.iteration >= 0:
            bits.append(f"iteration {self.iteration}")
        if self.step >= 0 and self.kind not in (COMPUTE, RECOMPUTE, ACT_UP, GRAD_UP, ACT_DOWN, GRAD_DOWN):
            bits.append(f"step {self.step}")
        if len(bits) == 1:  # nothing else identifies it: show the key
            bits.append(repr(self.key))
        bits.append(f"on {self.lane}")
        return " ".join(bits)

    def __repr__(self) -> str:
        return f"Task({self.key!r}, {self.describe()!r}, state={self.state})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (no run-time links); kinds and states are written as their strings."""
        return {
            "key": list(self.key),
            "kind": self.kind,
            "lane": self.lane,
            "priority": self.priority,
            "deps": [list(d) for d in self.deps],
            "device": self.device,
            "layers": [self.layers.start, self.layers.stop],
            "stage": self.stage,
            "stage_kind": self.stage_kind,
            "slot": self.slot,
            "microbatch": self.microbatch,
            "iteration": self.iteration,
            "round": self.round,
            "step": self.step,
            "part": self.part,
            "num_parts": self.num_parts,
            "nbytes": self.nbytes,
            "sync_deps": [list(d) for d in self.sync_deps],
            "seq": self.seq,
            "submit": self.submit_t,
            "issue": self.issue_t,
            "ready": self.ready_t,
            "start": self.start_t,
            "end": self.end_t,
            "state": self.state,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        stage_kind = d["stage_kind"]
        task = cls(
            key_from_json(d["key"]),
            _KIND_BY_NAME.get(d["kind"], d["kind"]),
            d["lane"],
            deps=[key_from_json(k) for k in d["deps"]],
            priority=d["priority"],
            device=d["device"],
            layers=range(*d["layers"]),
            stage=d["stage"],
            stage_kind=_STAGE_KIND_BY_NAME.get(stage_kind, stage_kind),
            slot=d.get("slot", -1),
            microbatch=d["microbatch"],
            iteration=d["iteration"],
            round=d.get("round", -1),
            step=d["step"],
            part=d["part"],
            num_parts=d["num_parts"],
            nbytes=d["nbytes"],
            sync_deps=[tuple(k) for k in d.get("sync_deps", ())],
        )
        task.seq = d["seq"]
        task.issue_t = d.get("issue", -1.0)
        task.submit_t = d["submit"]
        task.ready_t = d["ready"]
        task.start_t = d["start"]
        task.end_t = d["end"]
        task.state = TaskState(d["state"])
        return task

    def clone(self) -> Task:
        """A fresh, not-yet-run copy with the same declared fields (used by replay)."""
        task = Task.from_dict(self.to_dict())
        task.seq, task.state = -1, TaskState.NEW
        task.submit_t = task.ready_t = task.start_t = task.end_t = task.issue_t = -1.0
        return task
