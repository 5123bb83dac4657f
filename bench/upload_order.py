"""Workload E on the fake stream backend, its uploads issued in run order or not, its parameter
parts all at once or eight at a time.

Workload E (Qwen3-32B shape, LoRA, 4 x 4096 tokens, one device) as an H100 measured it
(`gpu_big.sh E` and `E-inputs`): per microbatch a decoder layer's forward 6.86 ms and backward
9.42 ms on the device, the embedding 1.12 / 0.01, the head 12.98 / 2.08; 975 MB of weights a
decoder layer, 1.56 GB the embedding and the head; 40 MiB a hidden state. The plans are the ones
those runs chose (17 slots at stage grain; 19 with every layer's input saved). Runs six
iterations (async, one round) on the fake stream backend, which issues ahead and runs each lane's
work in issue order as CUDA streams do, with the host's issuing charged (2 ms a compute task plus
1.5 ms a layer, 0.1 ms a transfer), and prints one JSON line per grain, link model and graph
(``free``: `ScheduleOptions.uploads_in_run_order` off; ``in_order``: the default; ``window``: in
order, and `ScheduleOptions.upload_parts_ahead` 8): milliseconds per settled iteration, tokens/s
and the compute lane's bubble. Link models: ``separate``, every copy stream at the full 52 GB/s (an
optimistic bound); ``shared``, one queue for all uploads in issue order (a pessimistic one: an
H100 interleaves the copy streams). Run: ``python bench/upload_order.py`` (CPU, a few seconds).

The fake backend starts a task's device work once its issuing is over: it models who waits for
whom, not the GPU's tokens/s.
"""

from __future__ import annotations

import argparse
import json

from roundpipe.backends.fake import FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.simulate import run_graphs, settled_iteration_ms
from roundpipe.sched.breakdown import breakdown
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import Task

DECODER_LAYERS, MICROBATCHES, ITERATIONS, TOKENS = 64, 4, 6, 4 * 4096
LAYER_BYTES, END_BYTES = 975_175_680, 1_555_824_640
# Stage boundaries of the measured plans: forward stages, then the fused stage to the last layer;
# the backward stages mirror the forward ones (recompute_grain "layer_input": shifted by one).
PLANS = {
    "stage": ((0, 7, 14, 21, 29, 37, 44, 51, 58), (0, 8, 15, 23, 30, 37, 44, 51, 58)),
    "layer_input": ((0, 6, 13, 20, 26, 32, 38, 45, 52, 59), (0, 7, 13, 20, 26, 32, 38, 45, 52, 59)),
}


def issue_ms(task: Task) -> float:
    """The host's time to issue ``task`` (module docstring)."""
    if task.kind in ("compute", "recompute"):
        return 2.0 + 1.5 * len(task.layers)
    return 0.1


def _stages(bounds: tuple[int, ...], last: int) -> tuple[range, ...]:
    return tuple(range(a, b) for a, b in zip(bounds, (*bounds[1:], last), strict=True))


GRAPHS = ("free", "in_order", "window")


def simulate(grain: str, link: str, graph: str, link_gbps: float) -> dict[str, object]:
    layers = DECODER_LAYERS + 2
    costs = LayerCosts(
        (1.12, *[6.86] * DECODER_LAYERS, 12.98),
        (0.01, *[9.42] * DECODER_LAYERS, 2.08),
        (END_BYTES, *[LAYER_BYTES] * DECODER_LAYERS, END_BYTES),
    )
    forward_bounds, backward_bounds = PLANS[grain]
    forward = _stages(forward_bounds, forward_bounds[-1])[:-1]
    backward = _stages(backward_bounds, backward_bounds[-1])[:-1][::-1]
    plan = Plan.from_stages(forward, range(forward_bounds[-1], layers), backward, costs, 1, MICROBATCHES)
    spec = ModelSpec(
        param_bytes=costs.mem_bytes,
        owners=((), *[(i,) for i in range(1, layers - 1)], ()),
        act_bytes=4096 * 5120 * 2,
        grad_bytes=(0, *[27_000_000] * DECODER_LAYERS, 0),
    )
    options = ScheduleOptions(
        round_size=MICROBATCHES,
        chunk_bytes=64 << 20,
        layer_inputs=grain == "layer_input",
        uploads_in_run_order=graph != "free",
        upload_parts_ahead=8 if graph == "window" else None,
    )
    model = FakeCostModel(costs, link_gbps=link_gbps)
    backend = FakeStreamBackend(model, shared_link=link == "shared", issue_ms=issue_ms)
    _, trace = run_graphs(backend, GraphBuilder(plan, spec, 1, options), ITERATIONS, MICROBATCHES)
    ms = settled_iteration_ms(trace, ITERATIONS)
    return {
        "bench": "upload_order",
        "grain": grain,
        "link": link,
        "graph": graph,
        "slots": plan.num_slots,
        "ms_per_iteration": round(ms, 1),
        "tokens_per_s": round(TOKENS / ms * 1e3, 1),
        "bubble": round(breakdown(trace, range(2, ITERATIONS)).bubble, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=52.0)
    args = parser.parse_args()
    for grain in PLANS:
        for link in ("separate", "shared"):
            for graph in GRAPHS:
                print(json.dumps(simulate(grain, link, graph, args.link_gbps)), flush=True)


if __name__ == "__main__":
    main()
