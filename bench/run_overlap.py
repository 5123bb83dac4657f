"""Workload F's stage runs on the fake stream backend: how often a run's first compute goes in
before the last of the run before it, and what each way of keeping runs in order costs an
iteration.

Why: a stage run that dequantizes its 4-bit weights once (`roundpipe.backends.dense_runs`) holds
their dense copies from its first compute to its last, so two runs' copies meet where the device
starts a forward run's first microbatch while the run before waits for its next input. Three
graphs: ``free``, uploads issued as soon as their dependencies are (`ScheduleOptions.
uploads_in_run_order` off); ``computes``, that graph with each run's first compute after the
device's previous run's last (built here by adding the dependency); ``uploads``, the default, each
run's uploads issued after the previous run's (`roundpipe.sched.forward_run` says why).

F as an H100 measured it (per decoder layer and microbatch 10.7 ms forward, 14.0 backward; 483 MB
uploaded a decoder layer at 45 GB/s; 4 x 4096 tokens, activations 64 MiB; the host's issue time of
a compute task 2.5 ms plus 3.0 a layer), one device, async, one round, stages of ``--sizes``
decoder layers. Prints one JSON line per stage size and graph: milliseconds per iteration once
settled (iterations 2 to 5) and the runs that overlapped. Run: ``python bench/run_overlap.py``
(CPU, about a minute). The fake backend models who waits for whom, not tokens/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from roundpipe.backends.fake import FakeCostModel
from roundpipe.backends.fake_streams import FakeStreamBackend
from roundpipe.plan import LayerCosts, Plan
from roundpipe.planning.simulate import run_graphs, settled_iteration_ms
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import Task

DECODER_LAYERS, MICROBATCHES, ITERATIONS = 80, 4, 6
COMPUTES = ("compute", "recompute")


def issue_ms(task: Task) -> float:
    """The host's time to issue ``task`` (module docstring)."""
    return 2.5 + 3.0 * len(task.layers) if task.kind in COMPUTES else 0.1


class InOrder(GraphBuilder):
    """The graphs with each run's first compute after the device's previous run's last."""

    def forward_backward(self, iteration: int, step: int, num_microbatches: int) -> Any:
        graph = super().forward_backward(iteration, step, num_microbatches)
        last = getattr(self, "_last_compute", None)
        for task in graph.tasks:
            if task.kind not in COMPUTES:
                continue
            if task.part == 0 and last is not None and last.key not in task.deps:
                task.deps = (*task.deps, last.key)
            if task.part == task.num_parts - 1 and task.kind == "compute":
                last = task
        self._last_compute = last
        return graph


ORDERS = ("free", "computes", "uploads")


def measure(size: int, order: str, link_gbps: float, decoders: int = DECODER_LAYERS) -> dict[str, Any]:
    upload = (1_050_000_000, *[483_000_000] * decoders, 2_100_000_000)
    layers = len(upload)
    costs = LayerCosts((1.0, *[10.7] * decoders, 20.0), (0.5, *[14.0] * decoders, 30.0), upload)
    owners = ((), *[(i,) for i in range(1, decoders + 1)], ())
    grads = (0, *[1_640_000] * decoders, 0)  # LoRA r16 on q/k/v/o, bf16
    spec = ModelSpec(param_bytes=upload, owners=owners, act_bytes=4096 * 8192 * 2, grad_bytes=grads)
    stages = tuple(range(i, min(i + size, layers - 2)) for i in range(0, layers - 2, size))
    plan = Plan.from_stages(stages, range(layers - 2, layers), stages[::-1], costs, 1, MICROBATCHES)
    options = ScheduleOptions(
        round_size=MICROBATCHES, chunk_bytes=64 << 20, uploads_in_run_order=order == "uploads"
    )
    builder = (InOrder if order == "computes" else GraphBuilder)(plan, spec, 1, options)
    backend = FakeStreamBackend(
        FakeCostModel(costs, link_gbps=link_gbps), shared_link=True, issue_ms=issue_ms
    )
    _, trace = run_graphs(backend, builder, ITERATIONS, MICROBATCHES)
    computes = sorted((t for t in trace if t.kind in COMPUTES and t.iteration >= 0), key=lambda t: t.start_t)
    overlapped = sum(
        1
        for before, after in itertools.pairwise(computes)
        if (before.iteration, before.slot) != (after.iteration, after.slot)
        and before.part != before.num_parts - 1
    )
    ms = settled_iteration_ms(trace, ITERATIONS)
    row = {"bench": "run_overlap", "stage_layers": size, "slots": plan.num_slots, "order": order}
    return row | {"ms_per_iteration": round(ms, 1), "runs_overlapped": overlapped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbps", type=float, default=45.0)
    parser.add_argument("--sizes", default="5,4,3")
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        for order in ORDERS:
            print(json.dumps(measure(size, order, args.link_gbps)), flush=True)


if __name__ == "__main__":
    main()
