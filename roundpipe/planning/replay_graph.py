"""The task graph of plan evaluation as flat lists: what `roundpipe.planning.replay` replays.

Why flat lists: plan evaluation needs, per task, only its resource, priority, duration and
dependencies, and replays them thousands of times per choice. The graph is the engine's own:
`GraphBuilder` (`roundpipe.sched.graph`) builds it for `roundpipe.planning.simulate.run_fake`'s evaluation
setup (one trainable unit per layer, default ``ScheduleOptions`` but the optimizer mode and round
size; free transfers and optimizer on the fake backend with shared links), and `_rendered` writes
its tasks down as numbers, in submission order. There is no second description of the schedule
here: a change to the graph reaches plan evaluation by itself.

Building `Task` objects is half the cost of an evaluation at 94 layers, so where the compiled
kernels were built (`roundpipe.plan.native`) their builder makes the same numbers directly: a
transcription of `GraphBuilder` for this setup, which `tests/test_plan_replay.py` proves equal,
array for array, to the rendering of the engine's graph on random plans. This module must never
model bytes, memory or costs the evaluator does not pass.
"""

from __future__ import annotations

import itertools
import math
from array import array
from types import ModuleType

from roundpipe.plan import native
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.partition import Plan
from roundpipe.plan.shape import RunShape
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    G_COPY,
    GRAD_DOWN,
    GRAD_UP,
    PARAM_UP,
    RECOMPUTE,
    Key,
    Task,
)

COMPUTE_RES, H2D_RES, D2H_RES = 0, 1, 2
"""Resources per device, numbered ``3 * device + offset``; the host optimizer lane comes last."""
HIGH, MID, LOW, P_COPY_LEVEL = 30, 20, 10, 12
"""Priorities as in `roundpipe.sched.task.PRIORITY`: activation and gradient transfers 30,
compute and parameter uploads 20, P-copies 12, gradient downloads and the rest of the optimizer
lane 10."""
SEQ = 1 << 20
"""Heap entries are ``(100 - priority) * seq + task``: one int, priority first, then the oldest.
``seq`` is SEQ, or the next power of two above a larger graph's task count: with SEQ every entry
stays under 2**30, one digit of a Python int, whose arithmetic and comparisons are the fast ones
(the replay's heaps run about a tenth faster than with 2**40)."""


class ReplayGraph:
    """One run's tasks as parallel lists, numbered in submission order (the engine's ``seq``)."""

    def __init__(self, num_devices: int) -> None:
        self.host = 3 * num_devices
        self.res: list[int] = []
        self.level: list[int] = []  # 100 - priority
        self.rank: list[int] = []  # heap key: priority, then submission order (`finish`)
        self.seq = SEQ
        self.dur: list[float] = []
        self.deps: list[list[int]] = []  # per task, what it waits for (owned: never changed after)
        self.batches: list[int] = []  # where each submitted batch ends
        self.computes: list[list[int]] = []  # per iteration: its `COMPUTE` tasks (not recomputes)
        self.losses: list[list[int]] = []  # per iteration: its fused stage's computes (the losses)
        self.packed_computes: tuple[array, array] | None = None  # `computes` as CSR, where `native` built it
        self._packed: tuple[array, ...] | None = None
        self._dependents: list[list[int]] | None = None

    def add(self, res: int, priority: int, dur: float, deps: list[int]) -> int:
        """A task waiting for ``deps``, a list the graph keeps (the caller never changes it).
        Dependents are derived once the graph is read (`dependents`, `packed`): here they would
        cost a list per task and a loop per edge, most of building."""
        task = len(self.res)
        self.res.append(res)
        self.level.append(100 - priority)
        self.dur.append(dur)
        self.deps.append(deps)
        return task

    @property
    def unmet(self) -> list[int]:
        """Per task, how many dependencies it waits for."""
        if not self.deps and self._packed is not None:  # built by `native`
            return self._packed[5].tolist()
        return list(map(len, self.deps))

    @property
    def dependents(self) -> list[list[int]]:
        """Per task, the tasks waiting for it, in task order (as the engine lists them)."""
        if self._dependents is None and not self.deps and self._packed is not None:
            offsets, flat = self._packed[3], self._packed[4]
            self._dependents = [flat[a:b].tolist() for a, b in itertools.pairwise(offsets)]
        if self._dependents is None:
            dependents: list[list[int]] = [[] for _ in self.deps]
            for task, deps in enumerate(self.deps):
                for dep in deps:
                    dependents[dep].append(task)
            self._dependents = dependents
        return self._dependents

    def end_batch(self) -> None:
        self.batches.append(len(self.res))

    def finish(self) -> None:
        """The heap keys, once the task count (and so ``seq``) is known."""
        self.seq = max(SEQ, 1 << len(self.res).bit_length())
        self.rank = [level * self.seq + task for task, level in enumerate(self.level)]
        self._packed = self._dependents = None

    def set_packed(self, packed: tuple[array, ...]) -> None:
        """A graph `native` built: its arrays as `packed` gives them (and no ``deps`` lists)."""
        self._packed = packed

    def packed(self) -> tuple[array, ...]:
        """The finished graph as arrays for `native`'s replay: resource, heap key, duration,
        dependents (offsets, flat), unmet and the batch ends. Packed once, on first use."""
        kernels = native.kernels()
        if self._packed is None and kernels is not None:
            deps_offsets, deps_flat = native.csr(self.deps)
            offsets, flat, unmet = kernels.invert(deps_offsets, deps_flat)
            self._packed = (
                *(native.ints(self.res), native.ints(self.rank), native.floats(self.dur)),
                *(offsets, flat, unmet, native.ints(self.batches)),
            )
        assert self._packed is not None, "packed() is for the compiled replay"
        return self._packed


def build_graph(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    async_optimizer: bool,
    round_size: int | None = None,
    *,
    lean: bool = True,
) -> ReplayGraph:
    """The tasks `GraphBuilder` makes for ``iterations`` chained iterations, each followed by its
    optimizer step, in `run_fake`'s submission batches (an iteration's graph, then its step).
    ``lean=False`` gives exactly `GraphBuilder`'s tasks and edges. ``lean`` (for a replay that
    ends with the last iteration: sync at its makespan, async where its first compute starts)
    leaves out what never decides a compute's start there:

    - a compute's (a recompute's) parameter uploads after the run's first microbatch: the run's
      previous compute waited for them, so they are met before it started and never decide when
      a task is ready (a compute waits for every upload: most of a graph's edges);
    - the last iteration's gradient downloads, G-copies and optimizer step. A zero-time task holds
      its lane for one wave, and only back from tasks that were ready with it and come after it in
      the lane's order (anything ready later finds the lane free again); these come after every
      other task of their lanes (gradient downloads after the activation downloads by priority,
      the host lane's tasks by age), and nothing else waits for them: in sync, they end when some
      compute does, so the makespan stays; in async, all but the step's P-copies wait for the
      last iteration's computes, after the replay's end."""
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size)
    kernels = native.kernels()
    if kernels is not None:  # the same graph, built compiled (`native`)
        return _built(kernels, plan, costs, shape, iterations, lean)
    return _rendered(plan, costs, shape, iterations, lean)


def _rendered(plan: Plan, costs: LayerCosts, shape: RunShape, iterations: int, lean: bool) -> ReplayGraph:
    """`build_graph` from `GraphBuilder`'s tasks, batch by batch as `run_fake` submits them."""
    spec = ModelSpec.uniform(plan.num_layers)
    options = ScheduleOptions(async_optimizer=shape.async_optimizer, round_size=shape.round_size)
    builder = GraphBuilder(plan, spec, shape.num_devices, options)
    render = _Renderer(plan, costs, shape.num_devices, lean)
    for it in range(iterations):
        last = lean and it == iterations - 1
        built = builder.forward_backward(it, it, shape.num_microbatches)
        tasks = built.tasks
        if last:  # no gradients: nothing the replay reads waits for them (see `build_graph`)
            tasks = [t for t in tasks if t.kind is not GRAD_DOWN and t.kind is not G_COPY]
        render.batch(tasks)
        render.graph.computes.append([render.index[t.key] for t in tasks if t.kind is COMPUTE])
        render.graph.losses.append([render.index[key] for key in built.loss_keys])
        if not last:
            render.batch(builder.optimizer_step(it))
    render.graph.finish()
    return render.graph


class _Renderer:
    """Writes `Task`s down as `ReplayGraph` numbers: the fake backend's resource (shared links),
    the task's priority, `FakeCostModel`'s duration and the dependencies by task number."""

    def __init__(self, plan: Plan, costs: LayerCosts, num_devices: int, lean: bool) -> None:
        self.graph = ReplayGraph(num_devices)
        self.index: dict[Key, int] = {}
        self.lean = lean
        self.durations = [_slot_ms(costs, s.kind, s.layers) for s in plan.slots]

    def batch(self, tasks: list[Task]) -> None:
        add, index, durations, host = self.graph.add, self.index, self.durations, self.graph.host
        for task in tasks:
            kind, dur, deps = task.kind, 0.0, task.deps
            if task.device < 0:
                res = host
            else:
                res = 3 * task.device + _OFFSET[kind]
                if kind is COMPUTE or kind is RECOMPUTE:
                    dur = durations[task.slot][kind is RECOMPUTE]
                    if self.lean and task.part > 0:  # the run's previous compute waited for them
                        deps = tuple(d for d in deps if d[0] is not PARAM_UP)
            index[task.key] = add(res, task.priority, dur, [index[d] for d in deps])
        self.graph.end_batch()


_OFFSET: dict[str, int] = {
    COMPUTE: COMPUTE_RES,
    RECOMPUTE: COMPUTE_RES,
    ACT_UP: H2D_RES,
    GRAD_UP: H2D_RES,
    PARAM_UP: H2D_RES,
    ACT_DOWN: D2H_RES,
    GRAD_DOWN: D2H_RES,
}
"""Each device task kind's resource, as the fake backend groups lanes on shared links."""


def _built(
    kernels: ModuleType, plan: Plan, costs: LayerCosts, shape: RunShape, iterations: int, lean: bool
) -> ReplayGraph:
    """`build_graph` by `native`'s builder: the plan and the round sizes in, the packed graph out
    (the dispatch it follows is `dispatch`'s, round by round from device 0)."""
    kinds = {SlotKind.FWD: 0, SlotKind.FUSED: 1, SlotKind.BWD: 2}
    times = [_slot_ms(costs, s.kind, s.layers) for s in plan.slots]
    saved = _saved_inputs(plan)
    packed = kernels.build(
        native.ints([kinds[s.kind] for s in plan.slots]),
        native.ints([s.layers.start for s in plan.slots]),
        native.ints([s.layers.stop for s in plan.slots]),
        native.floats([ms for ms, _ in times]),
        native.floats([ms for _, ms in times]),
        native.ints([by for by, _ in saved]),
        native.ints([by for _, by in saved]),
        native.ints(shape.rounds()),
        *(shape.num_devices, iterations, plan.num_layers, shape.async_optimizer, lean, SEQ),
    )
    res, rank, dur, dependents, batches, comp_offsets, computes, loss_offsets, losses, seq = packed
    graph = ReplayGraph(shape.num_devices)
    graph.res, graph.rank, graph.dur, graph.seq = res, rank, dur, seq
    graph.batches = batches.tolist()
    graph.computes = [computes[a:b].tolist() for a, b in itertools.pairwise(comp_offsets)]
    graph.packed_computes = (comp_offsets, computes)
    graph.losses = [losses[a:b].tolist() for a, b in itertools.pairwise(loss_offsets)]
    graph.set_packed((res, rank, dur, *dependents, batches))  # dependents: offsets, flat, unmet
    return graph


def _saved_inputs(plan: Plan) -> list[tuple[int, int]]:
    """Per slot: (saved_by, read_by) of a backward run, -1 for none: the forward slot whose saved
    activation its recompute reads, and the forward slot after it when that one starts where the
    backward stage does (its input upload is the same activation)."""
    stages = plan.fwd_stages
    saved: list[tuple[int, int]] = []
    for slot in plan.slots:
        start = slot.layers.start
        saved_by = read_by = -1
        if slot.kind == SlotKind.BWD and start > 0:
            saved_by = next(i for i, r in enumerate(stages) if r.start < start <= r.stop)
            read_by = saved_by + 1 if stages[saved_by].stop == start else -1
        saved.append((saved_by, read_by))
    return saved


def _slot_ms(costs: LayerCosts, kind: str, layers: range) -> tuple[float, float]:
    """A slot's (compute, recompute) durations as `FakeCostModel` gives them."""
    if kind == SlotKind.FWD:
        return costs.fwd_stage_ms(layers), 0.0
    if kind == SlotKind.FUSED:
        return costs.fused_stage_ms(layers), 0.0
    return math.fsum(costs.bwd_ms[layers.start : layers.stop]), costs.fwd_stage_ms(layers)
