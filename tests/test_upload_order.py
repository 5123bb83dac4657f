"""One device takes its stage runs in order: each run's uploads are issued after the previous run's.

On the fake stream backend (each lane a stream that runs its work in issue order, the host issuing
ahead as on CUDA), a one-device plan of E's proportions (a stage's weights upload in about two
thirds of its forward): without the order, the next run's inputs, issued while flow control still
holds the current run's last ones, wait on the copy stream for an activation still being computed
and stop the current run's inputs behind them; the compute lane then takes the next run's first
microbatches before the current run's last, and the bubble grows. With it, every lane runs the
runs in dispatch order and the step is shorter.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import pytest

from roundpipe.backends.fake import FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.simulate import run_graphs, settled_iteration_ms
from roundpipe.sched.breakdown import breakdown
from roundpipe.sched.gaps import find_gaps
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import ACT_UP, PARAM_UP, Task
from roundpipe.sched.trace import Trace

DECODER_LAYERS, MICROBATCHES, ITERATIONS = 12, 4, 5


def _run(
    in_order: bool, layer_inputs: bool = False, parts_ahead: int | None = None, shared_link: bool = False
) -> tuple[Trace, float]:
    """The scenario on the fake stream backend (``shared_link``: every upload in one queue, in
    issue order, as a GPU's copy engine serves them); its trace and settled ms per iteration."""
    layers = DECODER_LAYERS + 2
    costs = LayerCosts(
        (1.0, *[6.9] * DECODER_LAYERS, 13.0), (0.1, *[9.4] * DECODER_LAYERS, 2.1), (1 << 30,) * layers
    )
    forward = (range(0, 3), range(3, 5), range(5, 7), range(7, 9), range(9, 11))
    backward = tuple(reversed(forward))
    plan = Plan.from_stages(forward, range(11, layers), backward, costs, 1, MICROBATCHES)
    spec = ModelSpec(
        param_bytes=(1 << 30, *[975_000_000] * DECODER_LAYERS, 1 << 30),
        owners=((), *[(i,) for i in range(1, layers - 1)], ()),
        act_bytes=40 << 20,
    )
    options = ScheduleOptions(
        round_size=MICROBATCHES,
        chunk_bytes=64 << 20,
        uploads_in_run_order=in_order,
        layer_inputs=layer_inputs,
        upload_parts_ahead=parts_ahead,
    )
    backend = FakeStreamBackend(
        FakeCostModel(costs, link_gbps=52.0),
        shared_link=shared_link,
        issue_ms=lambda t: 2.0 + 1.5 * len(t.layers) if t.kind in ("compute", "recompute") else 0.1,
    )
    _, trace = run_graphs(backend, GraphBuilder(plan, spec, 1, options), ITERATIONS, MICROBATCHES)
    return trace, settled_iteration_ms(trace, ITERATIONS)


def _run_order(trace: Iterable[Task], lane_suffix: str) -> list[tuple[int, int, int]]:
    """(iteration, round, slot) of each task of the lane, in the order the device started them."""
    tasks = sorted((t for t in trace if t.lane.endswith(lane_suffix)), key=lambda t: t.start_t)
    return [(t.iteration, t.round, t.slot) for t in tasks]


def _interleaved(order: list[tuple[int, int, int]]) -> bool:
    """Whether a run reappears after another run has started: runs not taken one after another."""
    seen: set[tuple[int, int, int]] = set()
    for previous, current in itertools.pairwise(order):
        if current != previous:
            if current in seen:
                return True
            seen.add(previous)
    return False


def test_without_the_order_runs_interleave_and_the_step_is_longer() -> None:
    unordered, unordered_ms = _run(in_order=False)
    ordered, ordered_ms = _run(in_order=True)
    assert _interleaved(_run_order(unordered, ".compute"))  # the case is real
    assert not _interleaved(_run_order(ordered, ".compute"))
    assert ordered_ms < unordered_ms * 0.97


@pytest.mark.parametrize("layer_inputs", [False, True])
def test_every_lane_takes_the_runs_in_dispatch_order(layer_inputs: bool) -> None:
    trace, _ = _run(in_order=True, layer_inputs=layer_inputs)
    trace.check_rules()
    for lane in (".compute", ".act_up"):
        order = _run_order(trace, lane)
        assert not _interleaved(order), lane


def test_with_one_queue_for_all_uploads_a_few_parts_ahead_let_the_inputs_through() -> None:
    whole, whole_ms = _run(in_order=True, shared_link=True)
    windowed, windowed_ms = _run(in_order=True, shared_link=True, parts_ahead=8)
    behind_weights = [
        late
        for gap in find_gaps(whole)
        for late in gap.late
        if late.task.kind == ACT_UP
        and late.why == "behind on the link"
        and late.cause is not None
        and late.cause.kind == PARAM_UP
    ]
    assert behind_weights  # a run's whole upload queued ahead of the inputs
    assert windowed_ms < whole_ms * 0.97
    assert breakdown(windowed, range(2, ITERATIONS)).bubble < 0.01


@pytest.mark.parametrize(
    "microbatches,options",
    [
        (1, {}),
        (2, {"prefetch_stages": 2, "layer_inputs": True, "flow_depth": 1, "upload_parts_ahead": 3}),
        (3, {"inputs_ahead": False, "flow_depth": 3}),
        (4, {"round_size": 2, "layer_inputs": True, "upload_parts_ahead": 3}),
        (
            4,
            {
                "round_size": 2,
                "prefetch_stages": 2,
                "inputs_ahead": False,
                "layer_inputs": True,
                "flow_depth": 3,
            },
        ),
        (4, {"prefetch_stages": 2, "flow_depth": 1, "upload_parts_ahead": 3}),
    ],
)
def test_one_device_graphs_with_the_order_finish_and_keep_the_rules(
    microbatches: int, options: dict[str, Any]
) -> None:
    """Whatever else the graph holds (rounds, deeper prefetch, inputs not ahead, every layer's
    input, other flow depths, a parts window), the added order neither stalls it nor breaks a rule."""
    layers = 8
    costs = LayerCosts(
        (1.0, *[2.0] * (layers - 2), 3.0), (0.2, *[3.0] * (layers - 2), 1.0), (1 << 26,) * layers
    )
    forward = (range(0, 2), range(2, 4), range(4, 6))
    plan = Plan.from_stages(forward, range(6, layers), forward[::-1], costs, 1, microbatches)
    spec = ModelSpec.uniform(layers, param_bytes=1 << 26, act_bytes=1 << 20)
    graph = GraphBuilder(plan, spec, 1, ScheduleOptions(chunk_bytes=1 << 24, **options))
    backend = FakeStreamBackend(FakeCostModel(costs, link_gbps=20.0), shared_link=True, issue_ms=_quick_issue)
    engine, trace = run_graphs(backend, graph, 3, microbatches)
    assert engine.statistics().waiting == 0
    trace.check_rules()
    assert not _interleaved(_run_order(trace, ".act_up"))


def _quick_issue(task: Task) -> float:
    """A host that issues a compute task in 0.3 ms and a transfer in 0.05."""
    return 0.3 if task.kind in ("compute", "recompute") else 0.05
