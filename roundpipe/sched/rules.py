"""The five ordering rules, written once: as dependency builders and as a trace checker.

Why per *unit* and never per model: a unit is the set of trainable parameters one layer owns
(a parameter shared by two layers, such as tied embeddings, belongs to the shallower one and is
read by both). Binding every rule to one unit is what lets layer 0 of the next iteration start
while deep layers are still being stepped and copied.

Weight versions: version v means "v optimizer steps applied". Optimizer step s turns version s
into s+1 in the fp32 optimizer copy; P-copy(s) writes version s+1 into the compute copy that
devices read. Sync mode: the iterations of step s read version s. Async mode (staleness 1): they
read version max(0, s-1), except during an async warm-up (the first steps run synchronously)
and for *fresh* units (`ScheduleOptions.fresh_units`), which always read version s as in sync
mode: their deferred-free P-copy is what the next iteration's uploads of them wait for.

| # | rule | dependency |
| 1 | weight integrity | P-copy(u, s) waits for every parameter upload of u that read version s |
| 2 | no torn weights | a parameter upload reading version v > 0 waits for P-copy(u, v-1) |
| 3 | complete gradients | G-copy(u, t) waits for every gradient download of u in iteration t |
| 4 | gradient write order | the first gradient download of u in iteration t waits for the previous G-copy(u) |
| 5 | step semantics | per unit on the optimizer lane: step(s-1) -> P-copy(s-1) -> step(s), and |
|   |                | step(s-1) -> G-copy(t in s) -> step(s); shallow units first |

Rule 5 is slightly weaker than the chain step(s-1) -> P-copy(s-1) -> G-copy(s) -> step(s): in
async mode P-copy(s-1) must wait for the uploads of step s's iterations (rule 1), so forcing the
G-copies of those same iterations behind it would only add latency; G-copy touches the gradient
buffers and P-copy the weights, so the two commute (docs/design.md).

This module must never import torch or know how a task runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from roundpipe.errors import ScheduleError
from roundpipe.sched.task import G_COPY, GRAD_DOWN, P_COPY, PARAM_UP, STEP, Key, Task

if TYPE_CHECKING:
    from roundpipe.sched.trace import Trace

RULE_NAMES = {
    1: "weight integrity",
    2: "no torn weights",
    3: "complete gradients",
    4: "gradient write order",
    5: "step semantics",
}


class RuleViolation(ScheduleError):
    """A trace breaks an ordering rule (or a dependency, or a lane ran two tasks at once)."""

    def __init__(self, rule: int | str, message: str, tasks: Sequence[Task] = ()) -> None:
        name = f"rule {rule} ({RULE_NAMES[rule]})" if isinstance(rule, int) else str(rule)
        super().__init__(f"{name} broken: {message}")
        self.rule = rule
        self.tasks = list(tasks)


def weight_version(step: int, async_optimizer: bool, sync_steps: int = 0) -> int:
    """The weight version the iterations of optimizer step ``step`` read (the first
    ``sync_steps`` steps of an async run are synchronous: the async warm-up)."""
    return max(0, step - 1) if async_optimizer and step >= sync_steps else step


def deferred_p_copy(step: int, async_optimizer: bool, sync_steps: int = 0) -> bool:
    """Whether P-copy(step) is scheduled with step+1, after that step's uploads (async: the
    version it writes is first read by step+2's iterations), rather than right after step(step)."""
    return async_optimizer and step + 1 >= sync_steps


class UnitLedger:
    """Keys of the tasks that touched one unit so far: what the rules need to add dependencies."""

    __slots__ = ("grad_downloads", "last_g_copy", "p_copy", "readers", "step")

    def __init__(self) -> None:
        self.readers: dict[int, list[Key]] = {}  # version -> uploads that read it
        self.p_copy: dict[int, Key] = {}  # version written -> P-copy
        self.grad_downloads: dict[int, list[Key]] = {}  # iteration -> gradient downloads
        self.last_g_copy: Key | None = None
        self.step: dict[int, Key] = {}  # step -> optimizer step task


# --------------------------------------------------------------------- dependency builders


def weight_integrity(ledger: UnitLedger, step: int) -> list[Key]:
    """Rule 1: P-copy(step) waits for the uploads that read version ``step``."""
    return ledger.readers.pop(step, [])


def no_torn_weights(ledger: UnitLedger, version: int, base_version: int = 0) -> list[Key]:
    """Rule 2: an upload of ``version`` waits for the P-copy that wrote it (versions up to
    ``base_version`` were already in the compute copy when scheduling began)."""
    if version <= base_version:
        return []
    key = ledger.p_copy.get(version)
    if key is None:
        raise ScheduleError(
            f"weight version {version} is read before P-copy(step {version - 1}) was scheduled: "
            "call step() before the forward_backward that needs its weights"
        )
    return [key]


def complete_gradients(ledger: UnitLedger, iteration: int) -> list[Key]:
    """Rule 3: G-copy(iteration) waits for every gradient download of that iteration."""
    return ledger.grad_downloads.pop(iteration, [])


def gradient_write_order(ledger: UnitLedger) -> list[Key]:
    """Rule 4: the first gradient download of a new iteration waits for the last G-copy."""
    return [] if ledger.last_g_copy is None else [ledger.last_g_copy]


def g_copy_after_step(ledger: UnitLedger, step: int, *, sync: bool) -> list[Key]:
    """Rule 5: a G-copy of an iteration of ``step`` waits for step(step-1) (and, in sync mode,
    for P-copy(step-1), which keeps the whole chain on the optimizer lane in order)."""
    deps = []
    prev = ledger.step.get(step - 1)
    if prev is not None:
        deps.append(prev)
    if sync:
        pc = ledger.p_copy.get(step)
        if pc is not None:
            deps.append(pc)
    return deps


def step_after_copies(ledger: UnitLedger, step: int, g_copies: Sequence[Key]) -> list[Key]:
    """Rule 5: step(step) waits for its G-copies, step(step-1) and P-copy(step-1)."""
    deps = list(g_copies)
    prev = ledger.step.get(step - 1)
    if prev is not None:
        deps.append(prev)
    pc = ledger.p_copy.get(step)  # P-copy(step-1) wrote version `step`
    if pc is not None:
        deps.append(pc)
    return deps


# --------------------------------------------------------------------- checker


def check_trace(trace: Trace) -> None:
    """Verify a finished trace: dependencies, one task per lane at a time, and the five rules."""
    tasks = trace.records
    check_dependencies(tasks)
    check_lanes(tasks)
    owners = _owners(trace)
    _check_weight_rules(tasks, owners)
    _check_gradient_rules(tasks, owners)
    _check_step_semantics(tasks)


def check_dependencies(tasks: Sequence[Task]) -> None:
    by_key = {t.key: t for t in tasks}
    for task in tasks:
        for dep_key in task.deps:
            dep = by_key.get(dep_key)
            if dep is not None and dep.end_t > task.start_t + 1e-9:
                raise RuleViolation(
                    "dependency",
                    f"{task.describe()} started at {task.start_t:.3f} ms before its dependency "
                    f"{dep.describe()} ended at {dep.end_t:.3f} ms",
                    [task, dep],
                )


def check_lanes(tasks: Sequence[Task]) -> None:
    per_lane: dict[str, list[Task]] = {}
    for task in tasks:
        per_lane.setdefault(task.lane, []).append(task)
    for lane, lane_tasks in per_lane.items():
        lane_tasks.sort(key=lambda t: (t.start_t, t.end_t))
        for a, b in itertools.pairwise(lane_tasks):
            if b.start_t < a.end_t - 1e-9:
                raise RuleViolation(
                    "lane", f"{lane} ran {a.describe()} and {b.describe()} at the same time", [a, b]
                )


def _owners(trace: Trace) -> list[list[int]] | None:
    owners = trace.meta.get("owners")
    return None if owners is None else [list(o) for o in owners]


def _units(task: Task, owners: list[list[int]] | None) -> set[int]:
    if owners is None:
        return set(task.layers)
    units: set[int] = set()
    for layer in task.layers:
        units.update(owners[layer])
    return units


def _check_weight_rules(tasks: Sequence[Task], owners: list[list[int]] | None) -> None:
    p_copies = {(t.layers.start, t.step): t for t in tasks if t.kind == P_COPY}
    uploads = [t for t in tasks if t.kind == PARAM_UP]
    for up in uploads:
        for unit in _units(up, owners):
            if (unit, up.step) in p_copies:  # rule 1: the next P-copy waits for this reader
                pc = p_copies[(unit, up.step)]
                if pc.start_t < up.end_t - 1e-9:
                    raise RuleViolation(
                        1,
                        f"{pc.describe()} started at {pc.start_t:.3f} ms while {up.describe()} "
                        f"(reading version {up.step}) ran until {up.end_t:.3f} ms",
                        [pc, up],
                    )
            if up.step > 0 and (unit, up.step - 1) in p_copies:  # rule 2
                pc = p_copies[(unit, up.step - 1)]
                if up.start_t < pc.end_t - 1e-9:
                    raise RuleViolation(
                        2,
                        f"{up.describe()} (reading version {up.step}) started at {up.start_t:.3f} ms "
                        f"before {pc.describe()} ended at {pc.end_t:.3f} ms",
                        [up, pc],
                    )


def _check_gradient_rules(tasks: Sequence[Task], owners: list[list[int]] | None) -> None:
    g_copies: dict[int, list[Task]] = {}
    for t in tasks:
        if t.kind == G_COPY:
            g_copies.setdefault(t.layers.start, []).append(t)
    for lst in g_copies.values():
        lst.sort(key=lambda t: t.iteration)
    downloads = [t for t in tasks if t.kind == GRAD_DOWN]
    for down in downloads:
        for unit in _units(down, owners):
            copies = g_copies.get(unit, [])
            for gc in copies:
                if gc.iteration == down.iteration and gc.start_t < down.end_t - 1e-9:
                    raise RuleViolation(
                        3,
                        f"{gc.describe()} started at {gc.start_t:.3f} ms before {down.describe()} "
                        f"ended at {down.end_t:.3f} ms",
                        [gc, down],
                    )
            earlier = [gc for gc in copies if gc.iteration < down.iteration]
            if earlier and down.start_t < earlier[-1].end_t - 1e-9:
                gc = earlier[-1]
                raise RuleViolation(
                    4,
                    f"{down.describe()} started at {down.start_t:.3f} ms before {gc.describe()} "
                    f"ended at {gc.end_t:.3f} ms",
                    [down, gc],
                )


def _check_step_semantics(tasks: Sequence[Task]) -> None:
    steps: dict[tuple[int, int], Task] = {}
    p_copies: dict[tuple[int, int], Task] = {}
    g_copies: list[Task] = []
    for t in tasks:
        if t.kind == STEP:
            steps[(t.layers.start, t.step)] = t
        elif t.kind == P_COPY:
            p_copies[(t.layers.start, t.step)] = t
        elif t.kind == G_COPY:
            g_copies.append(t)

    def before(a: Task | None, b: Task | None) -> None:
        if a is not None and b is not None and b.start_t < a.end_t - 1e-9:
            raise RuleViolation(5, f"{b.describe()} started before {a.describe()} ended", [a, b])

    for (unit, s), st in steps.items():
        before(st, p_copies.get((unit, s)))  # step(s) -> P-copy(s)
        before(p_copies.get((unit, s - 1)), st)  # P-copy(s-1) -> step(s)
        before(steps.get((unit, s - 1)), st)
    for gc in g_copies:
        unit, s = gc.layers.start, gc.step
        before(steps.get((unit, s - 1)), gc)  # step(s-1) -> G-copy
        before(gc, steps.get((unit, s)))  # G-copy -> step(s)
    # Shallow units first: of two steps of the same optimizer step that were both ready, the
    # shallower one starts first (deep units whose gradients arrive early may go ahead), unless
    # the deeper one is a fresh unit's, whose chain runs at a higher priority: the next forward
    # waits for it (async runs with fresh units, `GraphBuilder._unit_task`).
    by_step: dict[int, list[Task]] = {}
    for (_, s), st in steps.items():
        by_step.setdefault(s, []).append(st)
    for lst in by_step.values():
        lst.sort(key=lambda t: t.start_t)
        for i, later in enumerate(lst):
            for earlier in lst[:i]:
                if (-later.priority, later.layers.start) < (
                    -earlier.priority,
                    earlier.layers.start,
                ) and later.ready_t < earlier.start_t - 1e-9:
                    which = "shallower" if later.priority == earlier.priority else "more urgent"
                    raise RuleViolation(
                        5,
                        f"{earlier.describe()} started before the {which} {later.describe()}, "
                        "which was already ready",
                        [earlier, later],
                    )
