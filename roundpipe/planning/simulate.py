"""Simulation: the real engine and the real task graphs on the fake backend, under a virtual clock.

Why simulate with the engine itself rather than a separate model: a simulator that reimplements
the schedule drifts from what actually runs. Here `simulate` builds the same graphs the training
path builds (`GraphBuilder`), runs them through the same `Engine`, and only swaps the backend. It
answers "what bubble and makespan would this plan give" in milliseconds, and `replay` re-runs any
recorded trace (from a fake or a real run) with its recorded durations.

Why at the top of the package and not in `roundpipe.sched`: simulation joins the scheduler to one
backend (the fake one), and backends build on `roundpipe.sched`; placed in either, it would make
the two import each other. Here it sits above both. `roundpipe.sched.simulate` and friends still
resolve, lazily, to the names below (docs/design.md, "Import layers"). This module must never
import torch or a real backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from roundpipe.backends.fake import FakeBackend, FakeCostModel, Perturbation
from roundpipe.errors import PlanError
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import Plan
from roundpipe.plan.shape import RunShape
from roundpipe.sched.engine import Engine
from roundpipe.sched.event_loop import run_sync
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.spec import fresh_units_of
from roundpipe.sched.task import Key, Task
from roundpipe.sched.trace import BubbleReport, Trace
from roundpipe.sched.upkeep import EngineStatistics


@dataclass
class SimulationResult:
    bubble_ratio: float
    makespan_ms: float
    trace: Trace
    bubble: BubbleReport
    utilisation: dict[int, float]  # per device: busy fraction of the compute lane
    steady_bubble_ratio: float | None = None  # async runs of >= 3 iterations: bubble of the middle iterations
    statistics: EngineStatistics | None = None  # the engine's counts at the end (nothing left waiting)

    def to_dict(self) -> dict[str, object]:
        return {
            "bubble_ratio": self.bubble_ratio,
            "steady_bubble_ratio": self.steady_bubble_ratio,
            "makespan_ms": self.makespan_ms,
            "utilisation": {str(d): u for d, u in self.utilisation.items()},
            "tasks": len(self.trace),
        }


def simulate(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int = 1,
    async_optimizer: bool = True,
    link_gbps: float | None = None,
    *,
    param_bytes: Sequence[int] | None = None,
    act_bytes: int = 0,
    optimizer_ms: float = 0.0,
    latency_ms: float = 0.0,
    round_size: int | None = None,
    chunk_bytes: int | None = None,
    shared_link: bool = True,
    perturbation: object | None = None,
    fresh_layers: int = 0,
    fresh_at: Sequence[int] = (),
    after_loss: bool = False,
    loss_lag: int = 0,
    inputs_ahead: bool = True,
    prefetch_stages: int = 1,
) -> SimulationResult:
    """Run ``iterations`` iterations (each followed by an optimizer step) on the fake backend.

    ``param_bytes`` defaults to the layers' ``mem_bytes`` (used only when ``link_gbps`` is set).
    ``fresh_layers``: the deepest layers read fresh weights (`RunConfig.fresh_layers`); with
    ``optimizer_ms`` set, the makespan shows what their steps cost the next forward. ``fresh_at``:
    so do the layers at these indices. ``after_loss``: submit each iteration (and its step) only
    once the previous one's losses are in, as a training loop does (what async plans are evaluated
    on), not all at once; with ``loss_lag=1`` each loss is read an iteration late: t + 2 and its
    step go in once t's are. ``inputs_ahead``, ``prefetch_stages``: as in `ScheduleOptions`."""
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size, loss_lag)
    run = FakeRun(
        link_gbps=link_gbps,
        param_bytes=param_bytes,
        act_bytes=act_bytes,
        optimizer_ms=optimizer_ms,
        latency_ms=latency_ms,
        chunk_bytes=chunk_bytes,
        shared_link=shared_link,
        perturbation=perturbation,
        fresh_layers=fresh_layers,
        fresh_at=tuple(fresh_at),
        after_loss=after_loss,
        inputs_ahead=inputs_ahead,
        prefetch_stages=prefetch_stages,
    )
    engine, trace, iteration_computes = run_shaped(plan, costs, shape, iterations, run)
    report = trace.bubble_ratio()
    return SimulationResult(
        bubble_ratio=report.overall,
        makespan_ms=trace.makespan_ms(),
        trace=trace,
        bubble=report,
        utilisation={d: 1.0 - b for d, b in report.per_device.items()},
        steady_bubble_ratio=_steady_bubble(engine, trace, iteration_computes),
        statistics=engine.statistics(),
    )


@dataclass(frozen=True)
class FakeRun:
    """How a simulated run goes beyond its shape (`simulate`'s keyword arguments): the link, the
    bytes, the optimizer and latency costs, perturbations, fresh layers, and ``after_loss``."""

    link_gbps: float | None = None
    param_bytes: Sequence[int] | None = None
    act_bytes: int = 0
    optimizer_ms: float = 0.0
    latency_ms: float = 0.0
    chunk_bytes: int | None = None
    shared_link: bool = True
    perturbation: object | None = None
    fresh_layers: int = 0
    fresh_at: tuple[int, ...] = ()
    after_loss: bool = False
    inputs_ahead: bool = True
    prefetch_stages: int = 1


def run_fake(
    plan: Plan,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    async_optimizer: bool,
    *,
    round_size: int | None = None,
    after_loss: bool = False,
    loss_lag: int = 0,
) -> tuple[Engine, Trace, list[list[tuple[object, ...]]]]:
    """The run behind `simulate`, without its reports, as plan evaluation runs it (free transfers,
    a free optimizer): the engine, the trace and each iteration's compute keys (plan evaluation
    reads only a few start times, and the bubble reports would cost it a tenth of its time)."""
    shape = RunShape(num_devices, num_microbatches, async_optimizer, round_size, loss_lag)
    return run_shaped(plan, costs, shape, iterations, FakeRun(after_loss=after_loss))


def run_shaped(
    plan: Plan, costs: LayerCosts, shape: RunShape, iterations: int, run: FakeRun
) -> tuple[Engine, Trace, list[list[tuple[object, ...]]]]:
    """`run_fake` for any `FakeRun`: what `simulate` reports on."""
    if shape.loss_lag not in (0, 1):
        raise PlanError(f"loss_lag is 0 or 1 (iterations a loop reads its losses late), not {shape.loss_lag}")
    _check_counts(shape.num_devices, shape.num_microbatches, iterations)
    builder = _builder(plan, costs, shape, run)
    model = FakeCostModel(
        costs, link_gbps=run.link_gbps, optimizer_ms=run.optimizer_ms, latency_ms=run.latency_ms
    )
    backend = _fake_backend(model, run.perturbation, run.shared_link)
    # The fake backend's resource sharing changes who waits for whom: replay needs to know it.
    trace = Trace(meta={**builder.meta(), "shared_link": run.shared_link})
    engine = Engine(backend, trace=trace)
    iteration_computes: list[list[tuple[object, ...]]] = []
    run_sync(_submit_iterations(engine, builder, shape, iterations, run.after_loss, iteration_computes))
    return engine, trace, iteration_computes


def run_graphs(
    backend: FakeBackend, builder: GraphBuilder, iterations: int, num_microbatches: int
) -> tuple[Engine, Trace]:
    """``iterations`` of ``builder``'s graphs, each with its optimizer step, submitted at once on
    ``backend`` (any fake backend: one with streams, one perturbed): the engine and the trace."""
    options = builder.options
    shape = RunShape(builder.num_devices, num_microbatches, options.async_optimizer, options.round_size)
    trace = Trace(meta=builder.meta())
    engine = Engine(backend, trace=trace)
    run_sync(_submit_iterations(engine, builder, shape, iterations, False, []))
    return engine, trace


def settled_iteration_ms(trace: Trace, iterations: int) -> float:
    """Milliseconds per iteration of ``iterations`` submitted at once (`run_graphs`), from the
    last compute of iteration 1 to that of the last: the first, from an idle device, left out."""
    ends: dict[int, float] = {}
    for task in trace:
        if task.kind in ("compute", "recompute") and task.iteration >= 0:
            ends[task.iteration] = max(ends.get(task.iteration, 0.0), task.end_t)
    return (ends[iterations - 1] - ends[1]) / (iterations - 2)


def _builder(plan: Plan, costs: LayerCosts, shape: RunShape, run: FakeRun) -> GraphBuilder:
    """The graphs the training path would build for ``plan`` on a run of ``shape``."""
    spec = ModelSpec(
        param_bytes=tuple(run.param_bytes if run.param_bytes is not None else costs.mem_bytes),
        owners=tuple((layer,) for layer in range(costs.num_layers)),
        act_bytes=run.act_bytes,
    )
    options = ScheduleOptions(
        async_optimizer=shape.async_optimizer,
        round_size=shape.round_size,
        chunk_bytes=run.chunk_bytes,
        fresh_units=(
            fresh_units_of(spec.owners, run.fresh_layers, run.fresh_at)
            if shape.async_optimizer
            else frozenset()
        ),
        inputs_ahead=run.inputs_ahead,
        prefetch_stages=run.prefetch_stages,
    )
    return GraphBuilder(plan, spec, shape.num_devices, options)


async def _submit_iterations(
    engine: Engine,
    builder: GraphBuilder,
    shape: RunShape,
    iterations: int,
    after_loss: bool,
    iteration_computes: list[list[tuple[object, ...]]],
) -> None:
    """Submit every iteration and its step, all at once or as a training loop does
    (``after_loss``, reading each loss ``shape.loss_lag`` iterations late), recording the
    batches in the trace for `replay`, and each iteration's compute keys."""
    trace, loss_lag = engine.trace, shape.loss_lag
    batch_sizes: list[int] = []
    trace.meta["submit_batches"] = batch_sizes  # replay re-submits the same batches
    batch_after: list[int] = []
    trace.meta["submit_after"] = batch_after  # ... each once as many tasks are done as then

    def submit(tasks: list[Task]) -> None:
        batch_after.append(len(trace.records))
        batch_sizes.append(len(tasks))
        engine.submit(tasks)

    waiting: list[list[Key]] = []  # loss keys of iterations submitted ahead (loss_lag)
    for it in range(iterations):
        graph = builder.forward_backward(it, it, shape.num_microbatches)
        if after_loss and not loss_lag:  # as RoundPipe.forward_backward returns: once the losses are in
            submit(graph.tasks)
            await engine.wait(graph.loss_keys)
            step_tasks = builder.optimizer_step(it)
        else:
            step_tasks = builder.optimizer_step(it)
            submit(graph.tasks)
        submit(step_tasks)
        iteration_computes.append([t.key for t in graph.tasks if t.kind == "compute"])
        if after_loss and loss_lag:  # the loss one iteration late, before the next submission
            waiting.append(graph.loss_keys)
            if len(waiting) > loss_lag:
                await engine.wait(waiting.pop(0))
    await engine.wait()


def _check_counts(num_devices: int, num_microbatches: int, iterations: int) -> None:
    if num_devices < 1 or num_microbatches < 1 or iterations < 1:
        raise PlanError(
            f"simulate needs num_devices, num_microbatches and iterations >= 1 "
            f"(got {num_devices}, {num_microbatches}, {iterations})"
        )


def _fake_backend(model: FakeCostModel, perturbation: object | None, shared_link: bool) -> FakeBackend:
    if perturbation is not None and not isinstance(perturbation, Perturbation):
        raise TypeError("perturbation must be a roundpipe.backends.fake.Perturbation")
    return FakeBackend(model, perturbation=perturbation, shared_link=shared_link)


def _steady_bubble(
    engine: Engine, trace: Trace, iteration_computes: list[list[tuple[object, ...]]]
) -> float | None:
    """The bubble of the middle iterations (None under 3 iterations: there is no middle).

    The window runs from the start of iteration 1's first compute to the start of the last
    iteration's first compute: whole iterations, no fill or drain.
    """
    if len(iteration_computes) < 3:
        return None
    starts = [min(engine.task(k).start_t for k in keys) for keys in iteration_computes]
    return trace.bubble_ratio(start_ms=starts[1], end_ms=starts[-1]).overall


def replay(trace: Trace) -> Trace:
    """Re-run a recorded trace's task graph on the fake backend with the recorded durations.

    Tasks are submitted at their recorded submission times, in their recorded order and (when the
    trace says how, as `simulate` does) in the same batches, on a fake backend with the same link
    sharing, so a trace of a fake run replays to exactly the same order and times, and a trace of
    a real run shows how the same graph behaves without the noise of a real machine.
    """
    records = sorted(trace.records, key=lambda t: t.seq)
    recorded = {t.key: (t.start_t, t.end_t) for t in records}

    def duration(task: Task) -> float:
        start, end = recorded[task.key]
        now = backend.now()
        if now == start:
            return end - now  # now + (end - now) gives back the recorded end (ties stay ties)
        return end - start

    # A fake run whose devices shared one link per direction replays with the same sharing.
    backend = FakeBackend(durations=duration, shared_link=bool(trace.meta.get("shared_link", False)))
    out = Trace(meta=dict(trace.meta))
    engine = Engine(backend, trace=out)
    batches = _replay_batches(trace, records)

    async def main() -> None:
        for submit_t, batch, done in batches:
            if done is not None:
                # As many tasks done as when the run submitted it: a batch submitted after a
                # wait comes once its instant is over, one of a chained run before it advances.
                while len(out.records) < done and backend.advance():
                    pass
            else:
                # Finish what ended before this submission; what ends at that very time is still
                # running when the batch arrives (as a run submits before it advances).
                while backend.next_time() is not None and backend.next_time() < submit_t:  # type: ignore[operator]
                    backend.advance()
            backend.set_clock(max(backend.now(), submit_t))
            engine.submit(batch)
        await engine.wait()

    run_sync(main())
    return out


def _replay_batches(trace: Trace, records: list[Task]) -> list[tuple[float, list[Task], int | None]]:
    """The recorded submissions, to submit again: (submission time, fresh copies of its tasks,
    how many tasks were done when the run submitted them, where the trace says)."""
    batches: list[tuple[float, list[Task], int | None]] = []
    sizes = _batch_sizes(trace.meta.get("submit_batches"), len(records))
    after = trace.meta.get("submit_after") if sizes is not None else None
    if not isinstance(after, list) or len(after) != len(sizes or ()):
        after = None
    if sizes is None:  # unknown: tasks submitted at one time form one batch
        for task in records:
            if batches and batches[-1][0] == task.submit_t:
                batches[-1][1].append(task.clone())
            else:
                batches.append((task.submit_t, [task.clone()], None))
        return batches
    at = 0
    for index, size in enumerate(sizes):
        chunk = records[at : at + size]
        at += size
        if chunk:
            done = after[index] if after is not None else None
            batches.append((chunk[0].submit_t, [t.clone() for t in chunk], done))
    return batches


def _batch_sizes(sizes: object, count: int) -> list[int] | None:
    """The recorded submission batches, when they are known and describe exactly ``count`` tasks."""
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        return None
    return sizes if sum(sizes) == count else None
