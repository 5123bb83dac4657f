"""Iteration time of workload D on the fake stream backend, its inputs 2, 3 or 4 microbatches ahead.

Workload D (Qwen3-30B-A3B, 4 x 4096 tokens, one device) as an H100 measured it: per decoder layer
and microbatch 1.9 ms forward and 2.8 ms backward on the device, 1.24 GB uploaded a decoder layer
(0.62 GB the embedding, 1.24 GB the LM head); the host's time to issue a compute task, as fitted
to the same run's trace (`roundpipe.sched.breakdown`'s issue times): 2.5 ms a task plus 4.0 ms a
layer forward, 3.0 ms recomputing, 1.2 ms a layer backward, and 0.1 ms a transfer. The plan: stages
of ``--stage-layers`` decoder layers. Runs six iterations (async, one round) on the fake stream
backend, which issues ahead as the CUDA backend does and charges each task its issue time on its
lane, for each `ScheduleOptions.flow_depth`, and prints one JSON line each: milliseconds per
iteration once settled (iterations 2 to 5), and the same without any issue time for reference.
Run: ``python bench/flow_depth.py`` (CPU, about a minute).

The fake backend starts a task's device work only once its issuing is over, where a GPU starts
the kernels as they come: it is a model of who waits for whom, not a prediction of tokens/s.
"""

from __future__ import annotations

import argparse
import json

from roundpipe.backends.fake import FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.simulate import run_graphs, settled_iteration_ms
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import Task

DECODER_LAYERS, MICROBATCHES, ITERATIONS = 48, 4, 6
ISSUE_PER_LAYER_MS = {"fwd": 4.0, "fused": 4.0, "recompute": 3.0, "bwd": 1.2}


def issue_ms(task: Task) -> float:
    """The host's time to issue ``task`` (module docstring)."""
    if task.kind not in ("compute", "recompute"):
        return 0.1
    kind = "recompute" if task.kind == "recompute" else str(task.stage_kind)
    return 2.5 + ISSUE_PER_LAYER_MS[kind] * len(task.layers)


def iteration_ms(
    plan: Plan,
    costs: LayerCosts,
    spec: ModelSpec,
    depth: int,
    link_gbps: float,
    issue: bool,
    parts_ahead: int | None = None,
) -> float:
    options = ScheduleOptions(
        round_size=MICROBATCHES, chunk_bytes=64 << 20, flow_depth=depth, upload_parts_ahead=parts_ahead
    )
    builder = GraphBuilder(plan, spec, 1, options)
    model = FakeCostModel(costs, link_gbps=link_gbps)
    backend = FakeStreamBackend(model, shared_link=True, issue_ms=issue_ms if issue else 0.0)
    _, trace = run_graphs(backend, builder, ITERATIONS, MICROBATCHES)
    return settled_iteration_ms(trace, ITERATIONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=52.0)
    parser.add_argument("--stage-layers", type=int, default=2)
    parser.add_argument(
        "--parts-ahead", type=int, help="ScheduleOptions.upload_parts_ahead (default: no limit)"
    )
    args = parser.parse_args()
    upload = (620_000_000, *[1_240_000_000] * DECODER_LAYERS, 1_240_000_000)
    layers = len(upload)
    costs = LayerCosts((0.9, *[1.9] * DECODER_LAYERS, 4.3), (0.1, *[2.8] * DECODER_LAYERS, 1.1), upload)
    # LoRA on the decoder layers: each owns its adapters (a few MB of gradients); the rest is frozen.
    owners = ((), *[(i,) for i in range(1, DECODER_LAYERS + 1)], ())
    grads = (0, *[4_000_000] * DECODER_LAYERS, 0)
    spec = ModelSpec(param_bytes=upload, owners=owners, act_bytes=4096 * 2048 * 2, grad_bytes=grads)
    size = args.stage_layers
    stages = tuple(range(i, min(i + size, layers - 2)) for i in range(0, layers - 2, size))
    plan = Plan.from_stages(stages, range(layers - 2, layers), stages[::-1], costs, 1, MICROBATCHES)
    for depth in (2, 3, 4):
        row = {
            "bench": "flow_depth",
            "flow_depth": depth,
            "slots": plan.num_slots,
            "ms_per_iteration": round(
                iteration_ms(plan, costs, spec, depth, args.link_gbps, True, args.parts_ahead), 1
            ),
            "without_issue_ms": round(
                iteration_ms(plan, costs, spec, depth, args.link_gbps, False, args.parts_ahead), 1
            ),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
