"""The task graph of plan evaluation as flat lists: what `roundpipe.plan_replay` replays.

Why a second builder: `GraphBuilder` makes `Task` objects with keys, stage names and bytes for
every backend, and at 94 layers building them is half the cost of one plan evaluation. Plan
evaluation needs, per task, only its resource, priority, duration and dependencies. This module
makes exactly the tasks `GraphBuilder` makes for `roundpipe.simulate.run_fake`'s evaluation
setup (``ModelSpec`` with one trainable unit per layer, no activation bytes, default
``ScheduleOptions`` but the optimizer mode and round size; free transfers and optimizer on
the fake backend with shared links), in the same order and with the same dependencies, as
numbers. It follows `GraphBuilder`, `backward_run` and the five rules (`sched/rules.py`) step by
step; `tests/test_plan_replay.py` compares the two graphs task for task, so any change there must
be mirrored here. It must never import the scheduler, and never model bytes, memory or costs
the evaluator does not pass.
"""

from __future__ import annotations

import itertools
import math
from array import array
from types import ModuleType

from roundpipe.plan import native
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.dispatch import SlotRun, dispatch
from roundpipe.plan.kinds import SlotKind
from roundpipe.plan.partition import Plan
from roundpipe.plan.rounds import round_sizes

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

    - dependencies met before another one of the same task (see `_Builder._uploads`);
    - the last iteration's gradient downloads, G-copies and optimizer step. A zero-time task holds
      its lane for one wave, and only back from tasks that were ready with it and come after it in
      the lane's order (anything ready later finds the lane free again); these come after every
      other task of their lanes (gradient downloads after the activation downloads by priority,
      the host lane's tasks by age), and nothing else waits for them: in sync, they end when some
      compute does, so the makespan stays; in async, all but the step's P-copies wait for the
      last iteration's computes, after the replay's end."""
    kernels = native.kernels()
    if kernels is not None:  # the same builder, compiled (`native`)
        return _built(
            kernels, plan, costs, num_devices, num_microbatches, iterations, async_optimizer, round_size, lean
        )
    builder = _Builder(plan, costs, num_devices, num_microbatches, async_optimizer, lean)
    first_device = 0
    for it in range(iterations):
        runs, first_device = dispatch(
            plan,
            num_microbatches,
            num_devices,
            iteration=it,
            first_device=first_device,
            round_size=round_size,
        )
        last = lean and it == iterations - 1
        builder.iteration(it, runs, gradients=not last)
        builder.graph.end_batch()
        if not last:
            builder.optimizer_step(it)
            builder.graph.end_batch()
    builder.graph.finish()
    return builder.graph


def _built(
    kernels: ModuleType,
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    async_optimizer: bool,
    round_size: int | None,
    lean: bool,
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
        native.ints(round_sizes(num_microbatches, num_devices, round_size)),
        *(num_devices, iterations, plan.num_layers, async_optimizer, lean, SEQ),
    )
    res, rank, dur, dependents, batches, comp_offsets, computes, loss_offsets, losses, seq = packed
    graph = ReplayGraph(num_devices)
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


class _Ledger:
    """`sched.rules.UnitLedger` for one layer, by task number."""

    __slots__ = ("grad_downloads", "last_g_copy", "p_copy", "readers", "step")

    def __init__(self) -> None:
        self.readers: dict[int, list[int]] = {}
        self.p_copy: dict[int, int] = {}
        self.grad_downloads: dict[int, list[int]] = {}
        self.last_g_copy = -1
        self.step: dict[int, int] = {}


class _Builder:
    """`GraphBuilder.forward_backward` and `optimizer_step`, on numbers (see the module docstring)."""

    def __init__(
        self, plan: Plan, costs: LayerCosts, num_devices: int, num_microbatches: int, asynch: bool, lean: bool
    ):
        self.plan = plan
        self.lean = lean
        self.graph = ReplayGraph(num_devices)
        self.asynch = asynch
        self.m = num_microbatches
        self.ledgers = [_Ledger() for _ in range(plan.num_layers)]
        self.history: dict[int, list[int]] = {}  # device -> last computes of its two latest runs
        self.one_device = num_devices == 1
        self.durations = [_slot_ms(costs, s.kind, s.layers) for s in plan.slots]
        self.saved = _saved_inputs(plan)  # per slot: (saved_by, read_by) of backward runs, -1: none

    def iteration(self, it: int, runs: list[SlotRun], gradients: bool = True) -> None:
        """The iteration's graph; without ``gradients``, no gradient downloads and G-copies."""
        version = max(0, it - 1) if self.asynch else it
        self.act_down = [[-1] * self.m for _ in range(self.plan.num_slots)]
        self.act_up = [[-1] * self.m for _ in range(self.plan.num_slots)]
        self.last_grad_down: dict[int, int] = {}
        self.computes: list[int] = []
        self.losses: list[int] = []
        for run in runs:
            history = self.history.setdefault(run.device, [])
            two_back = history[-2] if len(history) >= 2 else -1
            params = self._param_uploads(run, version, two_back)
            if run.slot.kind == SlotKind.BWD:
                # On one device a backward run's first recompute waits for the previous run's last
                # compute (`GraphBuilder._backward_context`).
                previous = history[-1] if history and self.one_device else -1
                last = self._backward_chains(run, params, two_back, previous)
            else:
                last = self._chains(run, params, two_back)
            history.append(last)
            if len(history) > 2:
                del history[0]
            if run.slot.kind != SlotKind.FWD and gradients:
                self._grad_download(it, run, last)
        self.graph.computes.append(self.computes)
        self.graph.losses.append(self.losses)
        if gradients:
            self._g_copies(it)

    def _param_uploads(self, run: SlotRun, version: int, two_back: int) -> list[int]:
        add, ledgers, h2d = self.graph.add, self.ledgers, 3 * run.device + H2D_RES
        keys = []
        for layer in run.slot.layers:
            ledger = ledgers[layer]
            deps = [two_back] if two_back >= 0 else []
            if version > 0:
                deps.append(ledger.p_copy[version])
            key = add(h2d, MID, 0.0, deps)
            keys.append(key)
            ledger.readers.setdefault(version, []).append(key)
        return keys

    def _uploads(self, params: list[int], before: list[int]) -> list[int]:
        """A run's compute (a backward run's recompute) after its parameter uploads and the run's
        previous one. Lean graphs leave the uploads out after the first microbatch: the previous
        compute waited for them, so they are met before it started and never decide when a task
        is ready (a compute waits for every upload: most of a graph's edges)."""
        if not before:
            return params
        return before[-1:] if self.lean else [*params, before[-1]]

    def _chains(self, run: SlotRun, params: list[int], two_back: int) -> int:
        """A forward or fused run: per microbatch act_up, compute, act_down."""
        add, d, slot = self.graph.add, 3 * run.device, run.slot.index
        ms = self.durations[slot][0]
        computes: list[int] = []
        for position, mb in enumerate(run.microbatches):
            deps = [self.act_down[slot - 1][mb]] if slot > 0 else []
            ahead = computes[position - 2] if position >= 2 else two_back
            if ahead >= 0:
                deps.append(ahead)
            up = self.act_up[slot][mb] = add(d + H2D_RES, HIGH, 0.0, deps)
            compute = add(d + COMPUTE_RES, MID, ms, [up, *self._uploads(params, computes)])
            self.act_down[slot][mb] = add(d + D2H_RES, HIGH, 0.0, [compute])
            computes.append(compute)
        self.computes += computes
        if run.slot.kind == SlotKind.FUSED:
            self.losses += computes
        return computes[-1]

    def _backward_chains(self, run: SlotRun, params: list[int], two_back: int, previous: int) -> int:
        """A backward run (`sched/backward_run.py`): act_up, recompute, grad_up, backward, act_down;
        ``previous`` (or -1): what its first recompute also waits for."""
        add, d, slot = self.graph.add, 3 * run.device, run.slot.index
        ms, recompute_ms = self.durations[slot]
        saved_by, read_by = self.saved[slot]
        backwards: list[int] = []
        for position, mb in enumerate(run.microbatches):
            ahead = backwards[position - 2] if position >= 2 else two_back
            flow = [ahead] if ahead >= 0 else []
            deps = list(flow)
            if saved_by >= 0:
                deps.append(self.act_down[saved_by][mb])
            if read_by >= 0:
                deps.append(self.act_up[read_by][mb])
            up = self.act_up[slot][mb] = add(d + H2D_RES, HIGH, 0.0, deps)
            before = [up, *self._uploads(params, backwards)]
            if not backwards and previous >= 0:
                before.append(previous)
            recompute = add(d + COMPUTE_RES, MID, recompute_ms, before)
            grad = add(d + H2D_RES, HIGH, 0.0, [self.act_down[slot - 1][mb], *flow])
            backward = add(d + COMPUTE_RES, MID, ms, [recompute, grad])
            self.act_down[slot][mb] = add(d + D2H_RES, HIGH, 0.0, [backward])
            backwards.append(backward)
        self.computes += backwards
        return backwards[-1]

    def _grad_download(self, it: int, run: SlotRun, last: int) -> None:
        layers, slot = run.slot.layers, run.slot.index
        deps = [last]
        previous = self.last_grad_down.get(slot)
        if previous is not None:
            deps.append(previous)
        else:
            deps += [self.ledgers[u].last_g_copy for u in layers if self.ledgers[u].last_g_copy >= 0]
        key = self.last_grad_down[slot] = self.graph.add(3 * run.device + D2H_RES, LOW, 0.0, deps)
        for unit in layers:
            self.ledgers[unit].grad_downloads.setdefault(it, []).append(key)

    def _g_copies(self, it: int) -> None:
        """Per layer, shallow first (every layer lies in a fused or backward stage): rules 3 and 5."""
        add, host = self.graph.add, self.graph.host
        for ledger in self.ledgers:
            deps = ledger.grad_downloads.pop(it, [])
            if it - 1 in ledger.step:
                deps.append(ledger.step[it - 1])
            if not self.asynch and it in ledger.p_copy:
                deps.append(ledger.p_copy[it])
            ledger.last_g_copy = add(host, LOW, 0.0, deps)

    def optimizer_step(self, step: int) -> None:
        """Per layer, shallow first: async, P-copy(step - 1) then step(step); sync, step(step)
        then P-copy(step)."""
        add, host = self.graph.add, self.graph.host
        for ledger in self.ledgers:
            if self.asynch and step > 0:
                self._p_copy(ledger, step - 1)
            deps = [ledger.last_g_copy]
            if step - 1 in ledger.step:
                deps.append(ledger.step[step - 1])
            if step in ledger.p_copy:
                deps.append(ledger.p_copy[step])
            ledger.step[step] = add(host, LOW, 0.0, deps)
            ledger.step.pop(step - 2, None)
            if not self.asynch:
                self._p_copy(ledger, step)

    def _p_copy(self, ledger: _Ledger, step: int) -> None:
        deps = ledger.readers.pop(step, [])
        if step in ledger.step:
            deps.append(ledger.step[step])
        ledger.p_copy[step + 1] = self.graph.add(self.graph.host, P_COPY_LEVEL, 0.0, deps)
        ledger.p_copy.pop(step - 1, None)


def _slot_ms(costs: LayerCosts, kind: str, layers: range) -> tuple[float, float]:
    """A slot's (compute, recompute) durations as `FakeCostModel` gives them."""
    if kind == SlotKind.FWD:
        return costs.fwd_stage_ms(layers), 0.0
    if kind == SlotKind.FUSED:
        return costs.fused_stage_ms(layers), 0.0
    return math.fsum(costs.bwd_ms[layers.start : layers.stop]), costs.fwd_stage_ms(layers)
